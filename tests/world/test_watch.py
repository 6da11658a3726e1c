"""Watching a running job: train.py --status against a live job (3 ranks, one lost, one joined, a
wrong key), with no job, or a bad address; --tensorboard's event files read back with
tensorboard's own reader, a resumed run continuing the same steps."""

import json
import os
import signal
import subprocess
import sys
import time

import procs
import pytest
from procs import checkpoint_position
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from utils.observe.instruments import environ_for

LONG = ["--epochs", "2", "--test-subset", "200", "--timeout", "60", "--save-every", "20", "--tensorboard", "tb"]
FIELDS = {"rank", "id", "host", "pid", "epoch", "epochs", "step", "steps", "images_per_second", "share"}
FIELDS |= {"heartbeat_seconds_ago", "loss", "seconds_left", "restarts", "rejoins"}


def status(port, cwd, *extra, timeout=30):
    return procs.train(["--status", f"127.0.0.1:{port}", *extra], timeout=timeout, cwd=str(cwd))


def job_status(port, cwd):
    result = status(port, cwd, "--json")
    return json.loads(result.stdout) if result.returncode == 0 else None


def wait_for_members(port, cwd, count, timeout, pid=None):
    """The job's --status once it trains on `count` members (with `pid` among them), every field known."""
    found = {}

    def ready():
        job = job_status(port, cwd)
        found["job"] = job
        return (
            job is not None
            and job["state"] == "training"
            and len(job["members"]) == count
            and all(None not in m.values() for m in job["members"])
            and (pid is None or pid in [m["pid"] for m in job["members"]])
        )

    procs.wait_for(ready, timeout, f"{count} members in --status (last: {found.get('job')})")
    return found["job"]


def scalars(folder):
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events, {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.timeout(300)
def test_status_of_a_live_job_through_a_loss_and_a_join(tmp_path):
    """One job of 3 for every check: the table and the JSON with every field; a wrong key, refused
    and counted; rank 2 killed (2 members); rank 2 back with --join (3 again); then a SIGTERM ends
    the job, and rank 0's event files hold the curves and the two changes of members."""
    port = procs.free_port()
    ranks = procs.start_ranks(3, LONG, port, str(tmp_path))
    joiner = wrong = None
    try:
        procs.wait_for(lambda: checkpoint_position(tmp_path / "runs" / "checkpoint.pt") is not None, 120, "training")
        job = wait_for_members(port, tmp_path, 3, 30)
        assert [m["pid"] for m in job["members"]] == [p.pid for p in ranks]
        assert all(set(m) == FIELDS for m in job["members"]) and job["generation"] == 0, job
        assert all(m["share"] == pytest.approx(1 / 3, abs=0.02) and m["epochs"] == 2 for m in job["members"]), job
        table = status(port, tmp_path)
        assert table.returncode == 0 and len(table.stdout.splitlines()) == 5, table.stdout
        assert table.stdout.startswith("generation 0, training, 3 members"), table.stdout

        (tmp_path / "wrong.key").write_text("f" * 64)
        os.chmod(tmp_path / "wrong.key", 0o600)
        wrong = procs.popen(  # (it waits 5 s for an answer: meanwhile the job loses a rank)
            [sys.executable, procs.TRAIN, "--status", f"127.0.0.1:{port}", "--key-file", "wrong.key"],
            cwd=str(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        procs.kill_group(ranks[2])
        job = wait_for_members(port, tmp_path, 2, 60)
        assert [m["pid"] for m in job["members"]] == [p.pid for p in ranks[:2]] and job["generation"] == 1, job

        joiner = procs.popen(
            [*procs_argv(port, 2, 3), *LONG, "--join"],
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            cwd=str(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        job = wait_for_members(port, tmp_path, 3, 120, pid=joiner.pid)
        assert job["generation"] == 2 and job["members"][2]["id"] == 2, job

        out, err = wrong.communicate(timeout=30)
        assert wrong.returncode == 2 and err.count("\n") == 1 and not out, err
        assert f"no job answered at 127.0.0.1:{port} within 5 s with the key from --key-file wrong.key" in err, err

        procs.wait_for(  # (the first progress report, for the event files)
            lambda: (job_status(port, tmp_path) or {"members": [{"step": 0}]})["members"][0]["step"] > 938 // 10,
            120,
            "rank 0 past its first progress report",
        )
        ranks[0].send_signal(signal.SIGTERM)
        results = procs.wait_all([ranks[0], ranks[1], joiner], timeout=120)
    finally:
        for p in [*ranks, *(p for p in (joiner, wrong) if p is not None)]:
            procs.kill_group(p)
    assert [code for code, _, _ in results] == [3, 3, 3], [err for _, _, err in results]
    assert "signature" in results[0][1] + results[1][1], results[0][1]  # the wrong key's questions, counted

    events, curves = scalars(tmp_path / "tb")
    assert [v for _, v in curves["job/members"]][:1] == [3] and 2 in [v for _, v in curves["job/members"]]
    assert len(curves["train/learning_rate"]) == len(curves["train/loss"]) >= 1  # (at least 10 an epoch: below)
    steps = [s for s, _ in curves["train/loss"]]
    assert steps == sorted(steps) and steps[0] == 938 // 10, steps
    texts = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("job/membership/text_summary")]
    assert texts[0].startswith("lost 2: 2 members (0, 1)") and texts[1] == "joined 2: 3 members (0, 1, 2)", texts


def procs_argv(port, rank, world_size):
    return [sys.executable, procs.TRAIN, "--rank", str(rank), "--world-size", str(world_size)] + [
        "--init-method",
        f"tcp://127.0.0.1:{port}",
        "--gloo_socket_ifname",
        "lo",
    ]


@pytest.mark.timeout(60)
def test_status_with_no_job_or_a_bad_address_is_one_line_and_exit_2_without_torch(tmp_path):
    port = procs.free_port()
    (tmp_path / "job.key").write_text("f" * 64)
    os.chmod(tmp_path / "job.key", 0o600)
    probe = (
        "import sys, train; "
        f"code = train.main(['--status', '127.0.0.1:{port}', '--key-file', 'job.key']); "
        "print(code, 'torch' in sys.modules, 'tensorboard' in sys.modules)"
    )
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=str(tmp_path),
        env=dict(os.environ, PYTHONPATH=procs.REPO),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.stdout.split() == ["2", "False", "False"], (result.stdout, result.stderr)
    assert time.monotonic() - started < 8 and result.stderr.count("\n") == 1, result.stderr
    assert f"no job answered at 127.0.0.1:{port} within 5 s with the key from --key-file job.key" in result.stderr
    for argv, words in [
        (["--status", "no-port"], "malformed --status 'no-port'"),
        (["--status", "127.0.0.1:70000"], "malformed --status '127.0.0.1:70000'"),
        (["--status"], "--status needs HOST:PORT"),
        (["--status", f"127.0.0.1:{port}"], "no key for the job's control messages"),
        (["--json"], "--json goes with --status"),
    ]:
        bad = procs.train(argv, timeout=30, cwd=str(tmp_path))
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and words in bad.stderr, (argv, bad.stderr)


SHORT = ["--epochs", "2", "--train-subset", "640", "--test-subset", "100", "--tensorboard", "tb"]


@pytest.mark.timeout(200)
def test_event_files_read_back_and_a_resume_continues_the_same_steps(tmp_path):
    """2 epochs of 10 steps, stopped after step 13 and resumed: every curve once per step reported,
    none twice; an unwritable --tensorboard is one line before anything starts."""
    file = tmp_path / "a-file"
    file.write_text("")
    bad = procs.train([*SHORT, "--tensorboard", str(file / "tb")], timeout=30, cwd=str(tmp_path))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "cannot write --tensorboard" in bad.stderr, (
        bad.stderr
    )

    stopped = procs.train(
        SHORT, timeout=120, cwd=str(tmp_path), env=dict(os.environ, **environ_for(faults="0:13:TERM"))
    )
    assert stopped.returncode == 3 and "stopped after epoch 2, step 3/10" in stopped.stderr, stopped.stderr
    _, before = scalars(tmp_path / "tb")
    assert [s for s, _ in before["train/loss"]][-1] >= 13  # (steps past the checkpoint's may be drawn: purged below)
    resumed = procs.train([*SHORT, "--resume"], timeout=120, cwd=str(tmp_path))
    assert resumed.returncode == 0, resumed.stderr
    assert len(os.listdir(tmp_path / "tb")) == 2  # a second event file in the same run

    _, curves = scalars(tmp_path / "tb")
    assert [s for s, _ in curves["train/loss"]] == list(range(1, 21)), curves["train/loss"]
    for tag in ("time/step_seconds", "time/comm_share", "train/learning_rate"):
        assert [s for s, _ in curves[tag]] == list(range(1, 21)), (tag, curves[tag])
    assert [s for s, _ in curves["test/accuracy"]] == [10, 20] and [s for s, _ in curves["comm/bytes_per_step"]] == [
        10,
        20,
    ]
    assert all(v == 2 for _, v in curves["job/members"])
    rows = [json.loads(line) for line in (tmp_path / "runs" / "metrics.jsonl").read_text().splitlines()]
    assert [s for s, _ in rows[0]["losses"]] == list(range(1, 11)) and rows[-1]["losses"][-1][0] == 20
