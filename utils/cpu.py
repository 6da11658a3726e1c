"""How long a rank's own work takes, stalls included: what --balance measures (utils/balance.py).

    now = snapshot(group)                 this process's CPU so far, the calling thread's waits
                                          for a CPU, its CPU group's stalls, the clock
    own_seconds(earlier, later, threads)  the time the work between two snapshots took this rank

A rank that waits for its peers sleeps: that time is nobody's work. What counts is the CPU time of
all its threads (spread over its torch threads), plus the time it was held back: its training
thread ready to run but without a CPU (other people's jobs, an old server's load), or its CPU
group out of quota (a container's CPU limit, a shared server's share; also when only the thread
of a sum was running, which the training thread's waits would miss). Linux's schedstat gives the
waits (nanoseconds run, nanoseconds waiting on a run queue, time slices); the group's cpu.stat its
stalls (cgroup v1 throttled_time in nanoseconds, v2 throttled_usec).
"""

import math
import os
import time


def snapshot(group):
    """(CPU seconds of all threads, seconds the calling thread waited for a CPU, seconds `group`
    (a CpuGroup) was held back by its quota, the monotonic clock)."""
    with open("/proc/thread-self/schedstat", "rb") as f:
        _, waited, _ = f.read().split()
    return time.process_time(), int(waited) / 1e9, group.stalled(), time.monotonic()


def own_seconds(earlier, later, threads):
    """The time the work between two snapshots took: CPU over `threads`, plus the longer of the
    waits and the stalls (the two overlap; a group's stalls add up over the CPUs it runs on, so
    they are at most the time that passed)."""
    cpu, waited, stalled, passed = (b - a for a, b in zip(earlier, later))
    return cpu / threads + max(waited, min(stalled, passed))


class CpuGroup:
    """This process's CPU cgroup: how long its quota has held it back so far. Looked up again each
    second: a process may be moved into a group, or given a quota, at any moment."""

    def __init__(self):
        self.stat, self.looked = None, -math.inf

    def stalled(self):
        self.look()
        if self.stat is None:
            return 0.0
        try:
            with open(self.stat) as f:
                fields = dict(line.split() for line in f if line.count(" ") == 1)
        except (OSError, ValueError):
            return 0.0
        if "throttled_time" in fields:  # v1: nanoseconds
            return int(fields["throttled_time"]) / 1e9
        return int(fields.get("throttled_usec", 0)) / 1e6  # v2

    def cores(self):
        """The group's CPU quota in cores (v1: cpu.cfs_quota_us over cpu.cfs_period_us, v2: cpu.max),
        or None: no quota (or none to be read)."""
        self.look()
        if self.stat is None:
            return None
        folder = os.path.dirname(self.stat)
        try:
            if os.path.exists(os.path.join(folder, "cpu.max")):
                with open(os.path.join(folder, "cpu.max")) as f:
                    quota, period = f.read().split()[:2]
            else:
                with (
                    open(os.path.join(folder, "cpu.cfs_quota_us")) as f,
                    open(os.path.join(folder, "cpu.cfs_period_us")) as g,
                ):
                    quota, period = f.read().strip(), g.read().strip()
            return int(quota) / int(period) if quota != "max" and int(quota) > 0 and int(period) > 0 else None
        except (OSError, ValueError):
            return None

    def look(self):
        if time.monotonic() > self.looked + 1.0:
            self.stat, self.looked = stat_file(), time.monotonic()


def stat_file():
    """The cpu.stat of this process's own CPU cgroup (v1's cpu controller, else v2's), or None."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.strip().split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in sorted(lines, key=lambda line: line[1] == ""):  # v1 first
        if "cpu" in controllers.split(",") or controllers == "":
            root = f"/sys/fs/cgroup/{controllers}" if controllers else "/sys/fs/cgroup"
            stat = os.path.join(root, path.lstrip("/"), "cpu.stat")
            if os.path.exists(stat):
                return stat
    return None
