"""torchrun's agent store across restarts: a restarted rank never dials a dead peer's address, and
an attempt comes together after attempts that died half-way (utils/setup/distributed.py,
torchrun_attempt_store). The test plays the agent: it hosts the store and starts the workers.

One job (one store, one checkpoint) goes through every case in turn, so the first, training attempt
is made once: each later attempt finds the finished run and ends after the rendezvous."""

import datetime
import os
import subprocess
import sys
import time

import procs
import torch.distributed as dist
from procs import wait_for


def test_restarted_attempts_never_dial_a_dead_peer_and_come_together_after_attempts_that_died(tmp_path):
    """torchrun's agent keeps one store for the whole job, and a worker's gloo address stays in it
    after the worker dies. The test makes the race of a restart certain: in each restarted attempt,
    rank 1 starts 3 s before rank 0, so it must wait for rank 0's new address instead of dialling a
    dead attempt's ("connection refused"). Rank 0 must resume from the checkpoint without --resume,
    as after any torchrun restart (attempt 0 finished, so later attempts find nothing to do).

    Attempt 1, static rendezvous: both agents count the restart (TORCHELASTIC_RESTART_COUNT 1, 1).
    Attempt 2, --rdzv-backend c10d: the node whose worker was healthy restarts it without counting,
    so the two counts differ (1, 2); the ranks must still find each other.
    Attempts 3 and 4 died half-way and leave their traces in the store: in attempt 3 only rank 0
    came (it published itself as leader, then was killed), in attempt 4 only rank 1 (it answered
    that dead leader, then was killed). Attempt 5 must still come together, with rank 1 first.
    With per-rank start counters (an earlier version) every attempt after one like attempt 3
    failed: rank 0 had counted one start more than rank 1, so rank 1 joined under attempt 3's
    prefix and dialled that attempt's dead rank 0 ("connection refused")."""
    store, start = agent_store_and_workers(tmp_path)
    first = procs.wait_all([start(0, 0), start(1, 0)], timeout=120)
    assert all(code == 0 for code, _, _ in first), first
    for counts in ((1, 1), (1, 2)):  # static rendezvous; c10d with a healthy node
        restarted_with_rank_1_first(start, tmp_path, counts)

    done = store.get("train.py/leader")
    lonely = start(0, 3)
    try:
        wait_for(lambda: store.get("train.py/leader") != done, 60, "rank 0 of attempt 3 to lead")
        dead_leader = store.get("train.py/leader").decode()
    finally:
        procs.kill_group(lonely)
        lonely.wait()
    lonely = start(1, 4)
    try:
        wait_for(lambda: store.check([f"train.py/{dead_leader}/answer/rank-1"]), 60, "rank 1 to answer the dead leader")
    finally:
        procs.kill_group(lonely)
        lonely.wait()
    restarted_with_rank_1_first(start, tmp_path, (5, 5))
    store = None  # closes the agent's store (its port) now


def restarted_with_rank_1_first(start, tmp_path, counts):
    """An attempt whose rank 1 starts 3 s before rank 0 (TORCHELASTIC_RESTART_COUNT: counts[rank]):
    both must come together and exit 0, rank 0 reading the finished checkpoint without --resume."""
    late = [start(1, counts[1])]
    time.sleep(3)
    late.append(start(0, counts[0]))
    second = procs.wait_all(late, timeout=120)
    assert all(code == 0 for code, _, _ in second), (counts, second)
    assert f"{tmp_path / 'c.pt'} is a finished run" in second[1][1], (counts, second[1])  # read without --resume


def agent_store_and_workers(tmp_path):
    """Play torchrun's agent: (its store, start(rank, restart_count) -> a worker of a 2-rank job)."""
    port = procs.free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    cwd = procs.scratch_dir()

    def start(rank, restart_count):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_RESTART_COUNT=str(restart_count),
            OMP_NUM_THREADS="1",
        )
        return procs.popen(
            [
                sys.executable,
                procs.TRAIN,
                "--test-subset",
                "200",
                "--train-subset",
                "128",
                "--epochs",
                "1",
                "--metrics",
                "",
                "--timeout",
                "30",
                "--save-path",
                str(tmp_path / "m.pth"),
                "--checkpoint",
                str(tmp_path / "c.pt"),
            ],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    return store, start
