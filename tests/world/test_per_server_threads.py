"""Ranks started by their own commands take their share of the server's cores (utils/setup/threads.py):
3 ranks on this machine, none told how many threads, take 1 each instead of torch's default of every
core; an OMP_NUM_THREADS the user set is kept; the start line says so."""

import os
import subprocess
import sys

import procs
import pytest

from utils.setup.threads import cpus_here

ARGS = ["--epochs", "1", "--train-subset", "640", "--test-subset", "100", "--timeout", "60"]


@pytest.mark.timeout(200)
def test_per_server_commands_on_one_machine_share_its_cores(tmp_path):
    bare = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RING_HANDOFF")}
    port = procs.free_port()
    ranks = [
        procs.popen(
            [sys.executable, procs.TRAIN, "--rank", str(r), "--world-size", "3"]
            + ["--init-method", f"tcp://127.0.0.1:{port}", "--gloo_socket_ifname", "lo", *ARGS],
            env=dict(bare, OMP_NUM_THREADS="2") if r == 2 else bare,  # rank 2's user chose 2
            cwd=str(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(3)
    ]
    ended = procs.wait_all(ranks, timeout=180)
    assert [code for code, _, _ in ended] == [0, 0, 0], [err[-1500:] for _, _, err in ended]
    share = max(1, len(cpus_here()) // 3)
    start = next(line for line in ended[0][1].splitlines() if line.startswith("rank 0 of 3"))
    low, high = sorted((share, 2))
    counts = f"{low} torch thread{'s' if low > 1 else ''}" if low == high else f"torch threads {low}-{high}"
    assert start.endswith(f"1 host × 3 ranks, {counts} per rank (OMP_NUM_THREADS)"), start
