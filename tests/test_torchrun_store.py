"""torchrun's agent store across restarts: a restarted rank never dials a dead peer's address, and
an attempt comes together after attempts that died half-way (utils/distributed.py,
torchrun_attempt_store). The test plays the agent: it hosts the store and starts the workers."""

import datetime
import os
import subprocess
import sys
import time

import procs
import pytest
import torch.distributed as dist
from procs import wait_for


@pytest.mark.parametrize("restart_counts", [(1, 1), (0, 1)], ids=["static-rendezvous", "c10d-healthy-node"])
def test_a_restarted_rank_never_dials_the_address_of_its_dead_peer(tmp_path, restart_counts):
    """torchrun's agent keeps one store for the whole job, and a worker's gloo address stays in it
    after the worker dies. The test plays the agent (it hosts the store) and makes the race of a
    restart certain: attempt 1's rank 1 starts 3 s before rank 0, so it must wait for rank 0's new
    address instead of dialling attempt 0's dead one ("connection refused").

    restart_counts: the TORCHELASTIC_RESTART_COUNT the agents give ranks 0 and 1 in attempt 1.
    With --rdzv-backend c10d the node whose worker was healthy restarts it without counting, so
    the two counts differ; the ranks must still find each other, and rank 0 must resume from the
    checkpoint without --resume, as after any torchrun restart (attempt 0 finished, so attempt 1
    finds nothing to do)."""
    store, start = agent_store_and_workers(tmp_path)
    first = procs.wait_all([start(0, 0), start(1, 0)], timeout=120)
    assert all(code == 0 for code, _, _ in first), first
    late = [start(1, restart_counts[1])]
    time.sleep(3)
    late.append(start(0, restart_counts[0]))
    second = procs.wait_all(late, timeout=120)
    assert all(code == 0 for code, _, _ in second), second
    assert f"{tmp_path / 'c.pt'} is a finished run" in second[1][1], second[1]  # read without --resume
    del store


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
        return subprocess.Popen(
            [
                sys.executable,
                procs.TRAIN,
                "--test-subset",
                "1000",
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


def test_a_torchrun_attempt_comes_together_after_attempts_that_died_half_way(tmp_path):
    """Attempts that died half-way leave their traces in the agent's store: in attempt 2 only rank
    0 came (it published itself as leader, then was killed), in attempt 3 only rank 1 (it answered
    that dead leader, then was killed). Attempt 4 must still come together, with rank 1 first.
    With per-rank start counters (the earlier version) every attempt after one like attempt 2
    failed: rank 0 had counted one start more than rank 1, so rank 1 joined under attempt 2's
    prefix and dialled that attempt's dead rank 0 ("connection refused")."""
    store, start = agent_store_and_workers(tmp_path)
    first = procs.wait_all([start(0, 0), start(1, 0)], timeout=120)
    assert all(code == 0 for code, _, _ in first), first
    done = store.get("train.py/leader")
    lonely = start(0, 1)
    try:
        wait_for(lambda: store.get("train.py/leader") != done, 60, "rank 0 of attempt 2 to lead")
        dead_leader = store.get("train.py/leader").decode()
    finally:
        procs.kill_group(lonely)
        lonely.wait()
    lonely = start(1, 2)
    try:
        wait_for(lambda: store.check([f"train.py/{dead_leader}/answer/rank-1"]), 60, "rank 1 to answer the dead leader")
    finally:
        procs.kill_group(lonely)
        lonely.wait()
    late = [start(1, 3)]
    time.sleep(3)
    late.append(start(0, 3))
    last = procs.wait_all(late, timeout=120)
    assert all(code == 0 for code, _, _ in last), last
    assert f"{tmp_path / 'c.pt'} is a finished run" in last[1][1], last[1]
    store = None  # closes the agent's store (its port) now
