"""A loopback job of ranks held to fractions of a core by CPU quotas (scripts/throttle.py), whose
quotas can change while it runs: bench/balance/balance.py and bench/balance/balance_change.py run theirs here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from harness import REPO, throttle

from utils.observe.instruments import environ_for, read_events
from utils.setup.launch import die_with_parent, free_port, kill

TRAIN = str(REPO / "train.py")


class Job:
    """A loopback job of len(fractions) ranks, each held to its fraction of a core (None: free);
    `changes`: (step, rank, fraction) applied once rank 0 reports that step (its events: RING_INSTRUMENTS)."""

    def __init__(self, fractions, args, folder, changes=(), timeout=900.0, train=TRAIN):
        self.fractions, self.args, self.folder, self.train = fractions, args, Path(folder), train
        self.changes, self.timeout = sorted(changes), timeout
        self.events = self.folder / "events.jsonl"
        self.applied = []  # (time, step seen, rank, fraction)

    def run(self):
        """(rank 0's stdout, the events its ranks logged); raises if a rank fails or the job overruns."""
        self.folder.mkdir(parents=True, exist_ok=True)
        n, port = len(self.fractions), free_port()
        env = dict(os.environ, OMP_NUM_THREADS="1", **environ_for(events=str(self.events)))
        ranks, quotas = [], []
        logs = [open(self.folder / f"rank{r}.log", "w+") for r in range(n)]
        try:
            for r in range(n):
                where = ["--rank", str(r), "--world-size", str(n), "--init-method", f"tcp://127.0.0.1:{port}"]
                command = [sys.executable, self.train, *where, "--gloo_socket_ifname", "lo", *self.args]
                ranks.append(
                    subprocess.Popen(
                        command,
                        cwd=self.folder,
                        env=env,
                        stdout=logs[r],
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=die_with_parent,  # SIGTERM if this process dies, even by SIGKILL
                    )
                )
                quotas.append(throttle.CpuQuota(f"bench-balance-{r}").__enter__())
                quotas[r].add(ranks[r].pid)
                quotas[r].set(self.fractions[r])
            self._wait(ranks, quotas)
        finally:
            for p in ranks:
                kill(p, group=True)
            for q in quotas:
                q.__exit__(None, None, None)
            for f in logs:
                f.close()
        out = (self.folder / "rank0.log").read_text()
        failed = [r for r, p in enumerate(ranks) if p.returncode != 0]
        if failed:
            raise RuntimeError(f"rank {failed[0]} failed in {self.folder}:\n{out[-2000:]}")
        return out, read_events(self.events)

    def _wait(self, ranks, quotas):
        deadline, pending = time.monotonic() + self.timeout, list(self.changes)
        while any(p.poll() is None for p in ranks):
            if time.monotonic() > deadline:
                raise RuntimeError(f"a job overran {self.timeout:.0f} s: {self.folder}")
            if pending:
                step = max((e["step"] for e in read_events(self.events) if e["event"] == "shares"), default=0)
                while pending and step >= pending[0][0]:
                    at, rank, fraction = pending.pop(0)
                    quotas[rank].set(fraction)
                    self.applied.append((time.time(), step, rank, fraction))
            time.sleep(0.05)


def part_name(name):
    """A configuration's name as a folder name."""
    return re.sub(r"[^\w.-]+", "_", name)
