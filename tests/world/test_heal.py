"""A job heals itself: servers' commands on loopback (each rank its own process, as one per server),
brought back with no command typed (--restart on-failure, a frozen server's own wait), or by the
same command run again. The pure decisions: tests/unit/test_heal_logic.py. A cut cable on emulated
servers: tests/cluster/test_heal_cut.py."""

import os
import re
import signal

import procs
import pytest
from procs import final_digest

from utils.observe.instruments import environ_for

RUN = ["--epochs", "1", "--train-subset", "9600", "--test-subset", "200", "--timeout", "60", "--heartbeat", "2"]
STEPS = 150  # 9,600 images, 64 a step
# seconds every rank sleeps as a step begins (RING_INSTRUMENTS's pace), where a job must outlast a server's
# return: the 150 steps last at least 12 s on the fastest machine, at the CPU of 150 steps
PACE = 0.08
SHORT = [*RUN[:3], "6400", *RUN[4:]]  # 100 steps: where nothing must outlast a return


def joined_after(out, member):
    """The step after which the members say `member` joined (its line in a member's stdout)."""
    return int(re.search(rf"rank {member} joined after epoch 1, step (\d+);", out).group(1))


def stop_and_resume(cwd, legs):
    """The oracle: a local job stopped after each leg's step and resumed on the next leg's ranks;
    legs: [(ranks, stop after step or None)]. Returns the final digest."""
    for i, (ranks, step) in enumerate(legs):
        env = dict(os.environ, **environ_for(faults=f"0:{step}:TERM")) if step is not None else None
        result = procs.train([*RUN, "--nproc", str(ranks), *(["--resume"] if i else [])], 300, str(cwd), env)
        if step is not None:
            assert result.returncode == 3 and f"step {step}/{STEPS}" in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    return final_digest(result.stdout)


@pytest.mark.timeout(600)
def test_a_killed_server_comes_back_by_itself_and_the_job_ends_as_a_stop_and_resume(tmp_path):
    """--restart on-failure on every server; rank 1's training is killed (-9) at step 40. Its keeper
    starts it again, it finds the job and joins it; the job ends on 3 ranks with the bits of the same
    job stopped where it lost rank 1, resumed on 2, stopped where rank 1 came back, resumed on 3."""
    env = environ_for(faults="1:40:KILL", once=str(tmp_path / "fired"), pace=PACE)
    ranks = procs.start_ranks(3, [*RUN, "--restart", "on-failure"], cwd=tmp_path, env=env)
    try:
        results = procs.wait_all(ranks, timeout=400)
    finally:
        for r in ranks:
            procs.kill_group(r)
    assert [code for code, _, _ in results] == [0, 0, 0], [err for _, _, err in results]
    out, err1 = results[0][1], results[1][2]
    assert "train.py: rank 1: training killed by SIGKILL; starting it again in 1 s (restart 1)" in err1, err1
    lost = re.search(r"lost rank 1 at epoch 1, step \d+ \([^)]*\); continuing on 2 ranks from step (\d+)", out)
    j, k = int(lost.group(1)), joined_after(out, 1)
    back = re.search(r"rank 1 comes back after ([\d.]+) s out, (\d+) steps? missed", out)
    assert back and int(back.group(2)) == k - j, out
    assert float(back.group(1)) < 2 + 10  # within --heartbeat + 10 s of the kill
    assert re.search(
        r"rank 1: joined the job after epoch 1, step \d+, .*; back after [\d.]+ s out \(restart 1\)", results[1][1]
    )
    assert "parameters identical on all 3 ranks" in out
    reference = tmp_path / "reference"
    reference.mkdir()
    assert final_digest(out) == stop_and_resume(reference, [(3, j), (2, k), (3, None)])


@pytest.mark.timeout(400)
def test_the_same_command_run_again_joins_a_running_job_and_resumes_a_stopped_one(tmp_path):
    """No --restart: a killed server's command, typed again, joins the job that went on; the job
    stopped as a whole (SIGTERM), the same commands again (no --resume) resume it, bit for bit as a
    job never stopped."""
    ranks = procs.start_ranks(3, RUN, cwd=tmp_path, env=environ_for(faults="2:30:KILL", pace=PACE))
    port = int(re.search(r"tcp://127.0.0.1:(\d+)", " ".join(ranks[0].args)).group(1))
    again = None
    try:
        procs.wait_for(lambda: ranks[2].poll() is not None, 120, "rank 2 to be killed")
        again = procs.start_rank(2, 3, RUN, port, tmp_path, environ_for(pace=PACE))  # the same command, by hand
        results = procs.wait_all([ranks[0], ranks[1], again], timeout=300)
    finally:
        for p in [*ranks, *([again] if again else [])]:
            procs.kill_group(p)
    assert [code for code, _, _ in results] == [0, 0, 0], [err for _, _, err in results]
    assert re.search(r"rank 2: joined the job after epoch 1, step \d+", results[2][1]), results[2][1]
    assert "parameters identical on all 3 ranks" in results[0][1]

    whole = tmp_path / "whole"
    whole.mkdir()
    ranks = procs.start_ranks(3, SHORT, cwd=whole, env=environ_for(faults="0:40:TERM"))
    first = procs.wait_all(ranks, timeout=200)
    assert [code for code, _, _ in first] == [3, 3, 3], [err for _, _, err in first]
    ranks = procs.start_ranks(3, SHORT, cwd=whole)  # the same commands again
    second = procs.wait_all(ranks, timeout=200)
    assert [code for code, _, _ in second] == [0, 0, 0], [err for _, _, err in second]
    assert "resuming from runs/checkpoint.pt: epoch 1, after step 40" in second[0][1], second[0][1]
    straight = tmp_path / "straight"
    straight.mkdir()
    never_stopped = procs.wait_all(procs.start_ranks(3, SHORT, cwd=straight), timeout=200)
    assert final_digest(second[0][1]) == final_digest(never_stopped[0][1])


@pytest.mark.timeout(400)
def test_a_server_that_fails_at_every_restart_is_given_up_and_the_job_goes_on(tmp_path):
    """Rank 2 is killed at step 30, and its training then dies at every restart: its keeper backs off
    (1 s, 2 s) and gives up after --max-restarts 2 in one line; the job ends on 2 ranks."""
    run = SHORT
    port = procs.free_port()
    env = environ_for(faults="2:30:KILL,2:0:KILL:restart")
    ranks = [procs.start_rank(r, 3, run, port, tmp_path, env) for r in range(2)]
    ranks.append(procs.start_rank(2, 3, [*run, "--restart", "on-failure", "--max-restarts", "2"], port, tmp_path, env))
    try:
        results = procs.wait_all(ranks, timeout=300)
    finally:
        for r in ranks:
            procs.kill_group(r)
    assert [code for code, _, _ in results] == [0, 0, 1], [err for _, _, err in results]
    lines = results[2][2].strip().splitlines()
    assert lines == [
        "train.py: rank 2: training killed by SIGKILL; starting it again in 1 s (restart 1)",
        "train.py: rank 2: training killed by SIGKILL; starting it again in 2 s (restart 2)",
        "train.py: rank 2: gave up after 2 restarts in a row, none of them training a step (last: killed by "
        "SIGKILL); the job goes on without this server",
    ], lines
    assert "parameters identical on all 2 ranks" in results[0][1]


@pytest.mark.timeout(400)
def test_a_frozen_server_that_wakes_finds_the_job_gone_on_and_joins_it_again(tmp_path):
    """SIGSTOP at step 30: the others go on without rank 2 after --heartbeat. SIGCONT: it learns it was
    fenced out, waits for the job (--rejoin-timeout) and joins it at its next step, by itself."""
    events = tmp_path / "events.jsonl"
    env = environ_for(faults="2:30:STOP", events=str(events), pace=PACE)
    ranks = procs.start_ranks(3, RUN, cwd=tmp_path, env=env)
    try:
        procs.wait_for(lambda: procs.stat(ranks[2].pid)[0] == "T", 120, "rank 2 to stop itself")
        procs.wait_for(lambda: '"after": "shrank"' in events.read_text(), 60, "the others to go on without rank 2")
        os.kill(ranks[2].pid, signal.SIGCONT)
        results = procs.wait_all(ranks, timeout=300)
    finally:
        for r in ranks:
            procs.kill_group(r)
    assert [code for code, _, _ in results] == [0, 0, 0], [err for _, _, err in results]
    err2 = results[2][2]
    assert re.search(
        r"rank 2: the job went on without this rank \(generation 1\).*; waiting up to 300 s to join the job again", err2
    ), err2
    assert re.search(
        r"rank 2: joined the job after epoch 1, step \d+, .*; back after [\d.]+ s out$", results[2][1], re.M
    )
    assert "parameters identical on all 3 ranks" in results[0][1]
