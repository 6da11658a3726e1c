"""Faults: dead or missing peers, kills during saving, exact resume, mismatched ranks."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import procs
import pytest
from procs import checkpoint_position, final_digest, wait_for

from utils.setup.precision import refusal, this_cpu

# The test set only scores the runs; what these tests compare is the parameters' digest.
SUBSET = ["--test-subset", "200", "--train-subset", "1200", "--metrics", "", "--epochs", "2"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run that the resumed runs of this module must end with (the same settings in
    each: made once): (its final digest, its finished checkpoint)."""
    tmp = tmp_path_factory.mktemp("straight")
    run = procs.train(
        [*SUBSET, "--save-every", "3", "--checkpoint", str(tmp / "a.pt"), "--save-path", str(tmp / "a.pth")],
        timeout=200,
    )
    assert run.returncode == 0, run.stderr
    return final_digest(run.stdout), tmp / "a.pt"


def test_resume_mid_epoch_is_bit_identical_to_an_uninterrupted_run(straight, tmp_path):
    common = [*SUBSET, "--save-every", "3"]

    # The interrupted run updates lazily (utils/lazy.LazyUpdate): its checkpoints, and the
    # resumed run, must still match the plain, uninterrupted one bit for bit.
    checkpoint = tmp_path / "b.pt"
    args = [*common, "--lazy-update", "--checkpoint", str(checkpoint), "--save-path", str(tmp_path / "b.pth")]
    job = procs.popen(
        [sys.executable, procs.TRAIN, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:  # kill the whole job in the middle of epoch 1, just after a mid-epoch checkpoint
        wait_for(lambda: (checkpoint_position(checkpoint) or (0, 0)) >= (1, 6), 120, "a mid-epoch checkpoint")
        procs.kill_group(job)
        job.communicate(timeout=30)
    finally:
        procs.kill_group(job)
    epoch, step = checkpoint_position(checkpoint)
    assert epoch == 1 and 0 < step < 18, (epoch, step)  # 1200 images / 2 ranks / 32 = 19 steps per epoch

    resumed = procs.train([*args, "--resume"], timeout=200)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {checkpoint}: epoch 1, after step" in resumed.stdout
    assert final_digest(resumed.stdout) == straight[0]


def test_kills_during_saving_never_leave_a_broken_checkpoint(tmp_path):
    """One rank (rank 0 writes the checkpoint; a world of one starts one process, not a launcher and two
    ranks), killed four times at different points of its saves, then left to finish."""
    checkpoint = tmp_path / "c.pt"
    args = [
        "--test-subset",
        "200",
        "--train-subset",
        "4000",
        "--metrics",
        "",
        "--epochs",
        "1",
        "--save-every",
        "1",
        "--checkpoint",
        str(checkpoint),
        "--save-path",
        str(tmp_path / "m.pth"),
    ]

    def alone():  # rank 0 of a world of one, on a fresh port each time
        return ["--rank", "0", "--world-size", "1", "--init-method", f"tcp://127.0.0.1:{procs.free_port()}"]

    env = dict(os.environ, OMP_NUM_THREADS="1")
    positions = []
    for attempt in range(4):
        job = procs.popen(
            [sys.executable, procs.TRAIN, *alone(), *args, *(["--resume"] if attempt else [])],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            before = checkpoint_position(checkpoint) or (0, 0)
            wait_for(
                lambda before=before: (checkpoint_position(checkpoint) or (0, 0)) > before, 120, "a new checkpoint"
            )
            time.sleep(0.05 + 0.11 * attempt)  # land the kill at different points of a save (one per step)
            procs.kill_group(job)
            job.communicate(timeout=30)
        finally:
            procs.kill_group(job)
        position = checkpoint_position(checkpoint)
        assert position is not None, "the checkpoint did not load after a kill"
        positions.append(position)
    assert positions == sorted(positions) and positions[-1] > positions[0]
    # and the run still finishes from where the last kill left it
    done = procs.train([*alone(), *args, "--resume"], timeout=200, env=env)
    assert done.returncode == 0, done.stderr
    assert "resuming from" in done.stdout, done.stdout
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


# Each victim with another way of summing: the survivors notice in sum(), in the comm threads,
# (lazy) in the next forward's hooks, or (gloo) in the wait for gloo's asynchronous all_reduce;
# with --no-recover all must say so in one line, and the lowest survivor saves the last step
# (tests/world/test_recovery.py: without it, they go on).
@pytest.mark.parametrize(
    "victim, mode",
    [
        ("first", ["--overlap"]),
        ("middle", ["--lazy-update"]),
        ("last", ["--no-overlap"]),
        ("first", ["--allreduce", "gloo"]),
        ("last", ["--allreduce", "gloo", "--lazy-update"]),
    ],
)
def test_survivors_of_a_killed_rank_exit_quickly_with_one_line(victim, mode, tmp_path):
    timeout = 10
    ranks = procs.start_ranks(
        3,
        [
            *mode,
            "--no-recover",
            "--test-subset",
            "1000",
            "--train-subset",
            "30000",
            "--epochs",
            "1",
            "--metrics",
            "",
            "--timeout",
            str(timeout),
            "--save-every",
            "2",
            "--checkpoint",
            str(tmp_path / "c.pt"),
            "--save-path",
            str(tmp_path / "m.pth"),
        ],
    )
    try:
        wait_for(lambda: checkpoint_position(tmp_path / "c.pt") is not None, 120, "training to start")
        index = {"first": 0, "middle": 1, "last": 2}[victim]
        os.kill(ranks[index].pid, signal.SIGKILL)
        killed_at = time.time()
        results = procs.wait_all(ranks, timeout=timeout + 30)
        took = time.time() - killed_at
    finally:
        for r in ranks:
            procs.kill_group(r)
    assert took < timeout + 10
    for rank, (code, _out, err) in enumerate(results):
        if rank == index:
            assert code == -signal.SIGKILL
            continue
        assert code == 1, (rank, code, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith(f"train.py: rank {rank}: lost a peer"), lines[0]
        assert "to resume: python3 -u train.py" in lines[0] and lines[0].endswith("--resume"), lines[0]
        writer = 1 if index == 0 else 0
        if rank == writer:
            assert "(--no-recover); saved the checkpoint of epoch 1, step " in lines[0], lines[0]
        else:
            assert f"(--no-recover); rank {writer} saves the checkpoint of epoch 1, step " in lines[0], lines[0]
    said = re.search(r"saved the checkpoint of epoch 1, step (\d+)", results[writer][2])
    assert checkpoint_position(tmp_path / "c.pt") == (1, int(said.group(1)))  # the last step, not the last --save-every


def test_a_rank_that_never_shows_up(tmp_path):
    port = procs.free_port()
    args = [
        "--init-method",
        f"tcp://127.0.0.1:{port}",
        "--world-size",
        "3",
        "--gloo_socket_ifname",
        "lo",
        "--timeout",
        "8",
        "--metrics",
        "",
        "--save-path",
        str(tmp_path / "m.pth"),
    ]
    started = time.time()
    ranks = [
        procs.popen(
            [sys.executable, procs.TRAIN, "--rank", str(r), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in (0, 1)
    ]
    results = procs.wait_all(ranks, timeout=60)
    assert time.time() - started < 8 + 10 + 10  # + start-up (imports, data)
    assert results[0][0] == 1 and "not every rank joined" in results[0][2], results[0]
    assert results[1][0] != 0
    for _code, _out, err in results:
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize(
    "setting,values",
    [
        ("lr", ("0.004", "0.001")),
        ("batch-size", ("32", "16")),
        ("allreduce", ("two-pass", "ring")),
        ("seed", ("1", "2")),
        ("precision", ("fp32", "bf16")),
    ],
)
def test_ranks_with_different_settings_are_stopped_by_name(setting, values, tmp_path):
    port = procs.free_port()
    refused = refusal("bf16", this_cpu()) if setting == "precision" else None  # rank 1 refuses bf16 on this CPU
    timeout = "8" if refused else "20"  # (refused: rank 0 waits it out)
    ranks = [
        procs.popen(
            [
                sys.executable,
                procs.TRAIN,
                "--rank",
                str(r),
                "--world-size",
                "2",
                "--init-method",
                f"tcp://127.0.0.1:{port}",
                "--gloo_socket_ifname",
                "lo",
                f"--{setting}",
                values[r],
                "--timeout",
                timeout,
                "--metrics",
                "",
                "--save-path",
                str(tmp_path / f"m{r}.pth"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in (0, 1)
    ]
    results = procs.wait_all(ranks, timeout=60)
    if refused:
        (code_0, _, err_0), (code_1, _, err_1) = results
        assert code_1 == 2 and refused in err_1 and len(err_1.strip().splitlines()) == 1, err_1
        assert code_0 == 1 and "not every rank joined" in err_0 and len(err_0.strip().splitlines()) == 1, err_0
        results = []
    for code, _out, err in results:
        assert code == 2, err
        assert f"different --{setting}" in err and len(err.strip().splitlines()) == 1, err
    assert (
        list(tmp_path.iterdir()) == []
    )  # nothing written, and rank 0 removed its lock (utils/store/outputs.py) on exit


def test_port_in_use_and_unreachable_master(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = procs.train(
            [
                "--init-method",
                f"tcp://127.0.0.1:{port}",
                "--rank",
                "0",
                "--world-size",
                "2",
                "--timeout",
                "5",
                "--metrics",
                "",
                "--save-path",
                str(tmp_path / "m.pth"),
            ],
            timeout=60,
        )
    assert result.returncode == 2 and "already in use" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = procs.train(
        [
            "--init-method",
            f"tcp://127.0.0.1:{procs.free_port()}",
            "--rank",
            "1",
            "--world-size",
            "2",
            "--timeout",
            "5",
            "--metrics",
            "",
        ],
        timeout=60,
    )
    assert result.returncode == 2 and "could not reach rank 0" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_resume_refuses_a_different_global_batch(straight, tmp_path):
    """Another number of ranks may resume (tests/world/test_resize.py), but --batch-size is per rank: on 3 ranks
    instead of 2 it asks for 96 images a step instead of 64, and that changes the run. (The checkpoint:
    the module's uninterrupted run, 2 ranks at the default global batch of 64, copied.)"""
    checkpoint = tmp_path / "c.pt"
    checkpoint.write_bytes(straight[1].read_bytes())
    args = [*SUBSET, "--checkpoint", str(checkpoint), "--save-path", str(tmp_path / "m.pth"), "--batch-size", "32"]
    before = checkpoint.read_bytes()
    result = procs.train([*args, "--resume", "--nproc", "3"], timeout=120)
    assert result.returncode == 2, result.stderr
    assert "made with --global-batch 64, this run has 96" in result.stderr
    assert checkpoint.read_bytes() == before


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_torchrun_restarts_a_dead_worker_and_training_resumes(straight, tmp_path, rendezvous):
    """static: one agent with both workers (--master-port). c10d: two agents, one worker each, as on
    two servers (--rdzv-backend c10d); the worker of the second agent is killed."""
    common = [*SUBSET, "--save-every", "3"]
    checkpoint = tmp_path / "b.pt"
    train_args = [
        procs.TRAIN,
        *common,
        "--checkpoint",
        str(checkpoint),
        "--save-path",
        str(tmp_path / "b.pth"),
        "--timeout",
        "20",
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "1"]  # one restart must be enough
    port = str(procs.free_port())
    if rendezvous == "static":
        launches = [[*torchrun, "--nproc-per-node", "2", "--master-port", port, *train_args]]
    else:
        launches = [
            [
                *torchrun,
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "test",
                *train_args,
            ]
        ] * 2
    env = dict(os.environ, OMP_NUM_THREADS="1")  # as the straight run: the thread count changes the bits
    jobs = [
        procs.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for argv in launches
    ]
    try:
        wait_for(lambda: (checkpoint_position(checkpoint) or (0, 0)) >= (1, 6), 120, "a mid-epoch checkpoint")
        workers = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _is_worker(pid, checkpoint)]
        assert len(workers) == 2, workers
        victim = max(workers) if rendezvous == "static" else _child_of(jobs[-1].pid, workers)
        os.kill(victim, signal.SIGKILL)
        outputs = []
        for job in jobs:
            try:
                outputs.append(job.communicate(timeout=300))
            except subprocess.TimeoutExpired:
                for j in jobs:
                    procs.kill_group(j)
                out, err = job.communicate()
                raise AssertionError(
                    f"torchrun did not finish\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
                ) from None
    finally:
        for job in jobs:
            procs.kill_group(job)
    assert [job.returncode for job in jobs] == [0] * len(jobs), [err[-3000:] for _, err in outputs]
    out = "".join(out for out, _ in outputs)
    assert f"resuming from {checkpoint}" in out
    assert final_digest(out) == straight[0]
    assert "Connection refused" not in "".join(err for _, err in outputs)  # nobody dialled a dead peer


def _child_of(parent, pids):
    """The one of `pids` whose parent is `parent` (torchrun's agent runs its workers as children)."""
    children = [pid for pid in pids if int(procs.stat(pid)[1]) == parent]
    assert len(children) == 1, (parent, pids, children)
    return children[0]


def _is_worker(pid, marker):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().split(b"\0")
    except OSError:
        return False
    return str(marker).encode() in cmdline and b"torch.distributed.run" not in cmdline
