"""Slow servers for real: a CPU quota on processes, the way an older or shared server is slow.

    with CpuQuota("host1") as quota:      # a cgroup of its own, removed on the way out
        quota.add(rank.pid)                # the process and every child it starts from now on
        quota.set(0.5)                     # half a core (None: no limit); may change at any moment

The kernel's CPU controller enforces it (CFS bandwidth: a quota of CPU time per 10 ms period),
so a throttled rank computes, sends and waits at the speed it would have on a slower machine;
nothing in the trainer knows. cgroup v1 (the cpu controller's cpu.cfs_quota_us) and v2
(cpu.max) both work. Needs root. Groups are named after their owner's pid: one left behind by a
process killed with SIGKILL is removed by the next CpuQuota (remove_stale).
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
# 10 ms, not the kernel's default 100 ms: a rank held to half a core then runs half of every 10 ms,
# as on a slower server, instead of 50 ms flat out and then 50 ms stalled, which stalls a job that
# waits for it at every step in long bursts (bench/balance/NOTES.md)
PERIOD_US = 10_000
MIN_FRACTION = 0.1  # the kernel's least quota is 1 ms a period
NAME_PREFIX = "mnr-cpu"  # <prefix>-<owner pid>-<n>
_NAME_RE = re.compile(rf"^{NAME_PREFIX}-(\d+)-\d+$")
_counter = itertools.count()


class ThrottleError(RuntimeError):
    """No CPU controller to use (not root, or no cgroup v1 cpu / v2 cpu controller)."""


def controller() -> tuple[Path, int]:
    """(the folder new groups go in, the cgroup version)."""
    if (ROOT / "cpu" / "cpu.cfs_quota_us").exists():
        return ROOT / "cpu", 1
    unified = ROOT / "cgroup.controllers"
    if unified.exists() and "cpu" in unified.read_text().split():
        return ROOT, 2
    raise ThrottleError(f"no CPU controller under {ROOT} (cgroup v1 cpu or v2 cpu) to throttle with")


class CpuQuota:
    def __init__(self, label: str = ""):
        self.label, self.path, self.version = label, None, None

    def __enter__(self) -> CpuQuota:
        parent, self.version = controller()
        remove_stale(parent)
        if self.version == 2:
            try:  # the children of the root may use the cpu controller
                (parent / "cgroup.subtree_control").write_text("+cpu")
            except OSError as e:
                raise ThrottleError(f"cannot enable the cpu controller for new groups: {e}") from None
        self.path = parent / f"{NAME_PREFIX}-{os.getpid()}-{next(_counter)}"
        try:
            self.path.mkdir()
        except OSError as e:
            raise ThrottleError(f"cannot make a cgroup ({e.strerror}): {'needs root' if os.geteuid() else e}") from None
        return self

    def set(self, fraction: float | None) -> None:
        """At most `fraction` of one core from now on (None: no limit)."""
        if fraction is not None and not MIN_FRACTION <= fraction:
            raise ValueError(f"a CPU quota is at least {MIN_FRACTION} of a core, got {fraction}")
        quota = -1 if fraction is None else round(fraction * PERIOD_US)
        if self.version == 1:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.path / "cpu.max").write_text(f"{'max' if quota < 0 else quota} {PERIOD_US}")

    def add(self, pid: int) -> None:
        """Move process `pid` (all its threads) into the group; a child it starts later is in it too."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def __exit__(self, *exc) -> None:
        release(self.path)


def release(group: Path) -> None:
    """Move what is left in `group` back to its parent, then remove it."""
    try:
        pids = (group / "cgroup.procs").read_text().split()
    except OSError:
        return
    for pid in pids:
        try:
            (group.parent / "cgroup.procs").write_text(pid)
        except OSError:  # gone meanwhile
            pass
    try:
        group.rmdir()
    except OSError:
        pass


def remove_stale(parent: Path) -> list[str]:
    """Groups of ours whose owner is dead (a run killed with SIGKILL): moved out and removed."""
    removed = []
    for group in parent.glob(f"{NAME_PREFIX}-*"):
        match = _NAME_RE.match(group.name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            release(group)
            removed.append(group.name)
    return removed
