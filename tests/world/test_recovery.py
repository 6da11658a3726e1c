"""A lost rank costs at most the step in flight: real processes, real signals (RING_INSTRUMENTS's
faults make a rank send itself SIGKILL, SIGSTOP or SIGTERM at a chosen step, utils/observe/instruments.py).

The oracle: a job that loses a rank as step k+1 begins and goes on in place must end with the same
bits as the same job stopped by SIGTERM after step k and resumed with --resume on the survivors.
"""

import json
import os
import re
import signal
import time

import procs
import pytest
from procs import checkpoint_position, final_digest

from utils.observe.instruments import environ_for, read_events

SHORT = ["--epochs", "1", "--train-subset", "1920", "--test-subset", "200", "--timeout", "60"]
K = 12  # the step the faults come after (30 steps in all)


def faulted(fault, args, cwd, timeout=120):
    return procs.train([*SHORT, *args], timeout=timeout, cwd=cwd, env=dict(os.environ, **environ_for(faults=fault)))


_references = {}  # (flags, k) -> digest; --lazy-update changes when updates apply, not the bits


def reference(extra, cwd, k):
    """SIGTERM after step k on 3 ranks, then --resume on 2: the digest a shrink from 3 to 2 after k must end with."""
    key = (tuple(x for x in extra if x != "--lazy-update"), k)
    if key not in _references:
        _references[key] = stopped_and_resumed(extra, cwd, k)
    return _references[key]


def stopped_and_resumed(extra, cwd, k):
    stopped = faulted(f"0:{k}:TERM", ["--nproc", "3", *extra], cwd)
    assert stopped.returncode == 3 and f"stopped after epoch 1, step {k}/30" in stopped.stderr, stopped.stderr
    resumed = procs.train([*SHORT, "--nproc", "2", "--resume", *extra], timeout=120, cwd=cwd)
    assert resumed.returncode == 0, resumed.stderr
    return final_digest(resumed.stdout)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "fault, extra",
    [
        (f"1:{K + 1}:KILL:sum", ["--lazy-update"]),  # the middle rank, mid-sum
        ("0:*:KILL", []),  # rank 0, the leader and writer, as the step after the one the case above went on from begins
        (f"2:{K + 1}:KILL:sum", ["--no-overlap", "--allreduce", "ring"]),
    ],
    ids=["middle-kill-during-lazy-sum", "rank0-kill", "last-kill-ring"],
)
def test_a_shrink_in_place_ends_with_the_bits_of_a_stop_and_resume(fault, extra, tmp_path):
    if "*" in fault:  # it goes on from a step whose stop-and-resume is known: one reference run less (K if none)
        fault = fault.replace("*", str(1 + next((k for flags, k in _references if flags == tuple(extra)), K)))
    lost, at = int(fault[0]), int(fault.split(":")[1])
    (tmp_path / "shrunk").mkdir()
    (tmp_path / "stopped").mkdir()
    result = faulted(fault, ["--nproc", "3", *extra], str(tmp_path / "shrunk"))
    assert result.returncode == 0, result.stderr
    survivors = [r for r in range(3) if r != lost]
    # the step they go on from: the one before the fault's, or the fault's if the lost rank's part of its sums got
    # out before it died (with overlap, backward starts them)
    went_on = int(re.search(r"continuing on 2 ranks from step (\d+)", result.stdout).group(1))
    assert went_on == at - 1 or (went_on == at and fault.endswith(":sum")), result.stdout
    for r in survivors:  # one line on every survivor
        assert re.search(rf"rank {r}: lost rank {lost} at epoch 1, step ({at}|{at + 1}) \(", result.stdout), (
            result.stdout
        )
        assert f"continuing on 2 ranks from step {went_on} (members {survivors[0]}, {survivors[1]}," in result.stdout
    assert f"the job finished without rank {lost}" in result.stderr
    assert final_digest(result.stdout) == reference(extra, str(tmp_path / "stopped"), went_on)
    metrics = json.loads((tmp_path / "shrunk" / "runs" / "metrics.jsonl").read_text())
    assert metrics["images"] == 1920 and metrics["members"] == survivors and metrics["world_size"] == 2


@pytest.mark.timeout(300)
def test_powersgd_over_the_hierarchical_sum_goes_on_after_a_lost_rank(tmp_path):
    """PowerSGD loses the dead rank's error feedback; the hierarchical sum under it learns its hosts
    again. (Every --allreduce x --compress: bench/recovery/recovery_sums.py.)"""
    extra = ["--allreduce", "hierarchical", "--compress", "powersgd", "--powersgd-warmup", "2"]
    result = faulted(f"1:{K + 1}:KILL:sum", ["--nproc", "3", *extra], str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "the lost ranks’ PowerSGD error feedback is dropped" in result.stdout
    assert "continuing on 2 ranks" in result.stdout and "parameters identical on all 2 ranks" in result.stdout


@pytest.mark.timeout(300)
def test_two_servers_rank_0s_side_goes_on_and_rank_1s_side_stops_with_the_last_step(tmp_path):
    """Rank 1 alone is half of the job without its lowest rank: it must not go on (no split brain);
    it saves the step it completed last and exits 1."""
    result = faulted(f"0:{K + 1}:KILL", [], str(tmp_path))
    assert result.returncode != 0
    assert re.search(
        r"only rank 1 of 2 is reachable \(rank 0: [^)]+\): not a majority, so this side stops", result.stderr
    ), result.stderr
    assert f"saved the checkpoint of epoch 1, step {K} to runs/checkpoint.pt" in result.stderr
    assert checkpoint_position(tmp_path / "runs" / "checkpoint.pt") == (1, K)
    assert not (tmp_path / "runs" / "checkpoint.pt.lock").exists()


@pytest.mark.timeout(300)
def test_no_recover_saves_the_last_completed_step_and_exits_1(tmp_path):
    result = faulted(f"1:{K + 1}:KILL", ["--no-recover"], str(tmp_path))
    assert result.returncode == 1, result.stderr
    assert (
        f"(--no-recover); saved the checkpoint of epoch 1, step {K} to runs/checkpoint.pt; to resume:" in result.stderr
    ), result.stderr
    assert checkpoint_position(tmp_path / "runs" / "checkpoint.pt") == (1, K)
    resumed = procs.train([*SHORT, "--resume"], timeout=120, cwd=str(tmp_path))
    assert resumed.returncode == 0 and f"after step {K}" in resumed.stdout, resumed.stderr


@pytest.mark.timeout(300)
def test_a_frozen_rank_is_left_behind_and_fenced_out_when_it_wakes(tmp_path):
    """SIGSTOP: silence for --heartbeat seconds; the others go on. SIGCONT later: the woken rank
    finds the job went on without it, and stops without writing anything."""
    args = [
        *SHORT,
        "--nproc",
        "3",
        "--heartbeat",
        "2",
        "--epochs",
        "2",
        "--train-subset",
        "6400",
        "--metrics",
        "m.jsonl",
    ]
    events = tmp_path / "events.jsonl"
    launcher = procs.popen(
        [procs.sys.executable, procs.TRAIN, *args],
        cwd=tmp_path,
        env=dict(os.environ, **environ_for(faults=f"2:{K + 1}:STOP", events=str(events))),
        text=True,
        stdout=procs.subprocess.PIPE,
        stderr=procs.subprocess.PIPE,
        start_new_session=True,
    )
    try:

        def went_on():  # the survivors' first step without it (they have 200 steps to go: still running)
            return events.exists() and '"after": "shrank"' in events.read_text()

        procs.wait_for(lambda: procs.stopped_rank(launcher, 2), 60, "rank 2 to stop itself")
        procs.wait_for(went_on, 60, "the others to go on without rank 2")
        os.kill(procs.stopped_rank(launcher, 2), signal.SIGCONT)
        outcome = procs.supervise([launcher], timeout=180, poll=0.05)
    finally:
        procs.kill_group(launcher)
    out, err = outcome.outputs[0]
    assert not outcome.timed_out, err
    assert "lost rank 2 at epoch 1" in out and "(rank 2 was silent for 2 s)" in out, out
    assert "train.py: rank 2: the job went on without this rank (generation 1); it wrote nothing" in err, err
    assert "parameters identical on all 2 ranks" in out
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [row["images"] for row in rows] == [6400] * 2 and rows[-1]["members"] == [0, 1]


def test_bad_heartbeat_is_one_line():
    for value in ("0", "-1", "nan"):
        result = procs.train(["--heartbeat", value], timeout=30)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr


# 400 steps: the job must outlive both joiners' start-up (torch and the data: 2-3 s, 6 s on a busy
# machine); at 100 and 200, beside two CPU-bound processes, it ended before the refused one asked
JOIN_RUN = ["--epochs", "1", "--train-subset", "12800", "--test-subset", "200", "--timeout", "60", "--save-every", "5"]
# seconds every rank sleeps as a step begins (RING_INSTRUMENTS's pace): the 200 steps outlast a joiner's start
# (195 steps after step 5 take at least 9 s on the fastest machine), at half the CPU of 400 unpaced ones
PACE = 0.04


def join_argv(port, *extra):
    """A third server joining a loopback job of 2 on `port`."""
    return [
        procs.sys.executable,
        procs.TRAIN,
        *("--rank", "2", "--world-size", "3", "--init-method", f"tcp://127.0.0.1:{port}"),
        *("--gloo_socket_ifname", "lo", *JOIN_RUN, *extra, "--join"),
    ]


@pytest.mark.timeout(400)
def test_a_server_that_joins_grows_the_job_and_ends_with_the_bits_of_a_stop_and_resume(tmp_path):
    """A job of 2; a server with other settings asks to join and is refused, in one line, without
    disturbing it; a third server starts with --join and is taken in after some step k. The job must
    end as the same job stopped after k on 2 ranks and resumed on 3 would."""
    port, paced = procs.free_port(), environ_for(pace=PACE)
    ranks = procs.start_ranks(2, JOIN_RUN, port, str(tmp_path), env=paced)
    joiner = None
    try:
        procs.wait_for(
            lambda: checkpoint_position(tmp_path / "runs" / "checkpoint.pt") is not None, 120, "training to begin"
        )
        started = time.monotonic()
        joiner = procs.start_rank(2, 3, [*JOIN_RUN, "--join"], port, tmp_path, paced)
        one_thread = dict(os.environ, OMP_NUM_THREADS="1")  # (as every rank has)
        other = procs.run(join_argv(port, "--lr", "0.01"), timeout=60, cwd=str(tmp_path), env=one_thread)
        results = procs.wait_all([*ranks, joiner], timeout=300)
    finally:
        for p in [*ranks, *([joiner] if joiner else [])]:
            procs.kill_group(p)
    assert other.returncode == 2 and other.stderr.count("\n") == 1, other.stderr
    assert "refused this server: the job has --lr 0.004, this server has 0.01" in other.stderr, other.stderr
    assert [code for code, _, _ in results] == [0, 0, 0], [err for _, _, err in results]
    out, joined = results[0][1], results[2][1]
    k = int(
        procs.re.search(r"rank 2 joined after epoch 1, step (\d+); continuing on 3 ranks \(members 0, 1, 2", out).group(
            1
        )
    )
    assert f"rank 2: joined the job after epoch 1, step {k}, as rank 2 of 3 (members 0, 1, 2)" in joined, joined
    assert time.monotonic() - started < 60
    assert "parameters identical on all 3 ranks" in out
    rows = [json.loads(line) for line in (tmp_path / "runs" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["images"] == 12800 and rows[-1]["members"] == [0, 1, 2]

    reference = tmp_path / "reference"
    reference.mkdir()
    stopped = faulted(f"0:{k}:TERM", [*JOIN_RUN[:-2], "--nproc", "2"], str(reference))
    assert stopped.returncode == 3 and f"stopped after epoch 1, step {k}/200" in stopped.stderr, stopped.stderr
    resumed = procs.train([*JOIN_RUN[:-2], "--nproc", "3", "--resume"], timeout=200, cwd=str(reference))
    assert resumed.returncode == 0, resumed.stderr
    assert final_digest(out) == final_digest(resumed.stdout)


def first_steps(events):
    """The events of each member's first step after a change of members."""
    return [e for e in read_events(events) if e["event"] == "first-step"]


@pytest.mark.timeout(200)
def test_a_join_at_an_epochs_last_step_logs_the_first_step_on_the_new_members_in_the_next(tmp_path):
    """Epochs of one step: every join lands at an epoch's last step, and the first step on 3 ranks
    comes in the next epoch. bench/recovery/recovery.py times a join to that step's event and stops the job
    once it is seen; lost at an epoch's end, a trial ran on to the job's end and failed."""
    events = tmp_path / "events.jsonl"
    run = ["--epochs", "400", "--train-subset", "64", "--test-subset", "100", "--timeout", "60"]
    port, env = procs.free_port(), environ_for(events=str(events))
    ranks = procs.start_ranks(2, run, port, str(tmp_path), env=env)
    joiner = None
    try:
        procs.wait_for(
            lambda: checkpoint_position(tmp_path / "runs" / "checkpoint.pt") is not None, 120, "training to begin"
        )
        joiner = procs.start_rank(2, 3, [*run, "--join"], port, tmp_path, env=env)
        procs.wait_for(lambda: len(first_steps(events)) == 3, 150, "the first step on 3 ranks")
        for p in [*ranks, joiner]:  # (what follows is not this test's: the job is stopped there)
            p.send_signal(signal.SIGTERM)
        results = procs.wait_all([*ranks, joiner], timeout=60)
    finally:
        for p in [*ranks, *([joiner] if joiner else [])]:
            procs.kill_group(p)
    assert [code for code, _, _ in results] == [3, 3, 3], [err[-2000:] for _, _, err in results]
    firsts = first_steps(events)
    assert sorted(e["after"] for e in firsts) == ["grew", "grew", "joined"], firsts
    assert len({e["epoch"] for e in firsts}) == 1 and all(e["step"] == 1 and e["world_size"] == 3 for e in firsts)


@pytest.mark.timeout(200)
def test_join_to_nowhere_or_malformed_is_one_line_and_exit_2(tmp_path):
    """(A join with other settings, refused by a running job: in the test above.)"""
    port = procs.free_port()
    nowhere = procs.train(  # (with a key: without one it would not ask; tests/world/test_control_plane.py)
        ["--rank", "1", "--world-size", "2", "--init-method", f"tcp://127.0.0.1:{port}", "--timeout", "3", "--join"],
        timeout=60,
        cwd=str(tmp_path),
        env=dict(os.environ, RING_JOB_KEY="a" * 64),
    )
    assert nowhere.returncode == 2 and nowhere.stderr.count("\n") == 1, nowhere.stderr
    assert f"no running job answered at 127.0.0.1:{port} within 3 s" in nowhere.stderr
    malformed = procs.train(
        ["--rank", "1", "--world-size", "2", "--init-method", f"tcp://127.0.0.1:{port}", "--join", "nowhere"],
        timeout=60,
        cwd=str(tmp_path),
    )
    assert malformed.returncode == 2 and "malformed --join 'nowhere'" in malformed.stderr, malformed.stderr


@pytest.mark.timeout(300)
def test_under_torchrun_a_restart_resumes_from_the_step_before_the_fault(tmp_path):
    """torchrun restarts every worker after a failure (recovery is off under it): the survivor saves
    the last step it completed, so the restarted job loses at most the step in flight."""
    (tmp_path / "straight").mkdir()
    straight = procs.train([*SHORT, "--metrics", ""], timeout=120, cwd=str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr
    env = dict(os.environ, OMP_NUM_THREADS="1", **environ_for(faults=f"1:{K + 1}:KILL", once=str(tmp_path / "fired")))
    result = procs.run(
        [
            procs.sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--master-port",
            str(procs.free_port()),
            procs.TRAIN,
            *SHORT,
            "--metrics",
            "",
        ],
        timeout=240,
        cwd=str(tmp_path),
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"saved the checkpoint of epoch 1, step {K} to runs/checkpoint.pt" in result.stderr, result.stderr[-3000:]
    assert f"resuming from runs/checkpoint.pt: epoch 1, after step {K}" in result.stdout, result.stdout
    assert final_digest(result.stdout) == final_digest(straight.stdout)


@pytest.mark.timeout(400)
def test_five_ranks_rank_0_frozen_in_a_sum_then_a_rank_killed_while_rank_0_rejoins(tmp_path):
    """Five servers. Rank 0, the leader and writer, is frozen during a sum: the other four (a
    majority) go on, and rank 1 takes over writing. Woken, rank 0 is fenced out; started again with
    --join it is taken back in, and rank 4 is killed as the job takes it in: that growth fails, the
    survivors drop rank 4, and rank 0 asks again and gets in. The job ends on ranks 0-3, having
    trained every image of every epoch once."""
    args = [
        "--epochs",
        "2",
        "--train-subset",
        "12800",
        "--test-subset",
        "200",
        "--timeout",
        "60",
        "--heartbeat",
        "2",
        "--metrics",
        "m.jsonl",
        "--rejoin-timeout",
        "0",  # the fenced rank exits; the test joins it by hand (by itself: tests/world/test_heal.py)
    ]  # 400 steps: still running when rank 0 is back
    events, port = tmp_path / "events.jsonl", procs.free_port()
    ranks = procs.start_ranks(
        5, args, port, str(tmp_path), env=environ_for(faults=f"0:{K}:STOP:sum,4:0:KILL:join", events=str(events))
    )
    joiner = None
    try:
        procs.wait_for(lambda: procs.stat(ranks[0].pid)[0] == "T", 120, "rank 0 to stop itself")
        procs.wait_for(lambda: '"after": "shrank"' in events.read_text(), 60, "the others to go on without rank 0")
        os.kill(ranks[0].pid, signal.SIGCONT)
        fenced = procs.supervise([ranks[0]], timeout=30, grace=None, poll=0.05)
        assert not fenced.timed_out and ranks[0].returncode == 1, fenced.outputs
        assert "train.py: rank 0: the job went on without this rank (generation 1)" in fenced.outputs[0][1]
        joiner = procs.start_rank(0, 5, [*args, "--join"], port, tmp_path, env=environ_for(events=str(events)))
        results = procs.wait_all([*ranks[1:], joiner], timeout=300)
    finally:
        for p in [*ranks, *([joiner] if joiner else [])]:
            procs.kill_group(p)
    codes = [code for code, _, _ in results]
    assert codes == [0, 0, 0, -signal.SIGKILL, 0], results
    out = results[0][1]  # rank 1: rank 0 of the job from the loss of rank 0 on
    assert re.search(r"rank 1: lost rank 0 at epoch 1, step \d+ \([^)]+\); continuing on 4 ranks", out), out
    assert re.search(r"rank 1: lost rank 4 at epoch \d, step \d+ \([^)]+\); continuing on 3 ranks", out), out
    assert re.search(
        r"rank 0: joined the job after epoch \d, step \d+, as rank 3 of 4 \(members 1, 2, 3, 0\)", results[4][1]
    ), results[4]
    assert "parameters identical on all 4 ranks" in out
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [1, 2] and [row["images"] for row in rows] == [12800] * 2, rows
    assert rows[-1]["members"] == [1, 2, 3, 0]
