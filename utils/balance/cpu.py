"""How long a rank's own work takes, stalls included: what --balance measures (utils/balance/shares.py).

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

import ctypes
import math
import os
import threading
import time

# libc's pread through ctypes.PyDLL, whose calls keep the GIL: open() and os.read() let it go, and in
# a rank's step each time it went the sum's thread took it and the training thread waited to get it
# back (what that cost: bench/balance/NOTES.md, "Reading the CPU group's counters")
_libc = ctypes.PyDLL(None, use_errno=True)
_libc.pread.restype = ctypes.c_ssize_t
_libc.pread.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_long)


class CounterFile:
    """A file of the kernel's counters (in /proc, a cgroup), opened once and read from its start
    each time, the GIL held (a few microseconds). OSError if it cannot be opened or read."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_RDONLY)
        self.buffer = ctypes.create_string_buffer(4096)

    def read(self):
        size = _libc.pread(self.fd, self.buffer, len(self.buffer), 0)
        if size < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        return self.buffer.raw[:size].decode()

    def close(self):
        os.close(self.fd)


_schedstat = {}  # a thread's id: its CounterFile of /proc/self/task/ID/schedstat


def waited():
    """Seconds the calling thread has waited for a CPU so far (schedstat's second field)."""
    thread, text = threading.get_native_id(), None
    file = _schedstat.get(thread)
    if file is not None:
        try:
            text = file.read()
        except OSError:  # (a thread id used again by a new thread: its file is the old thread's)
            file.close()
    if text is None:
        _schedstat[thread] = file = CounterFile(f"/proc/self/task/{thread}/schedstat")
        text = file.read()
    return int(text.split()[1]) / 1e9


def snapshot(group):
    """(CPU seconds of all threads, seconds the calling thread waited for a CPU, seconds `group`
    (a CpuGroup) was held back by its quota, the monotonic clock)."""
    return time.process_time(), waited(), group.stalled(), time.monotonic()


def own_seconds(earlier, later, threads):
    """The time the work between two snapshots took: CPU over `threads`, plus the longer of the
    waits and the stalls (the two overlap; a group's stalls add up over the CPUs it runs on, so
    they are at most the time that passed)."""
    cpu, waited, stalled, passed = (b - a for a, b in zip(earlier, later))
    return cpu / threads + max(waited, min(stalled, passed))


class CpuGroup:
    """This process's CPU cgroup: how long its quota has held it back so far, and the quota. Looked
    up again each second (a process may be moved into a group, or given a quota, at any moment);
    its files stay open in between. folder: a group's folder, never looked up (tests)."""

    NAMES = ("cpu.stat", "cpu.max", "cpu.cfs_quota_us", "cpu.cfs_period_us")

    def __init__(self, folder=None):
        self.fixed, self.folder, self.files, self.looked = folder, None, {}, -math.inf

    def stalled(self):
        try:
            fields = dict(line.split() for line in self.read("cpu.stat").splitlines() if line.count(" ") == 1)
            if "throttled_time" in fields:  # v1: nanoseconds
                return int(fields["throttled_time"]) / 1e9
            return int(fields.get("throttled_usec", 0)) / 1e6  # v2
        except (OSError, ValueError):
            return 0.0

    def cores(self):
        """The group's CPU quota in cores (v1: cpu.cfs_quota_us over cpu.cfs_period_us, v2: cpu.max),
        or None: no quota (or none to be read)."""
        try:
            if "cpu.max" in self.look():
                quota, period = self.read("cpu.max").split()[:2]
            else:
                quota, period = self.read("cpu.cfs_quota_us").strip(), self.read("cpu.cfs_period_us").strip()
            return int(quota) / int(period) if quota != "max" and int(quota) > 0 and int(period) > 0 else None
        except (OSError, ValueError):
            return None

    def read(self, name):
        """The text of the group's file `name`; OSError if it has none."""
        if name not in self.look():
            raise FileNotFoundError(name)
        try:
            return self.files[name].read()
        except OSError:
            self.folder = None  # (a group removed: its files are opened again at the next look)
            raise

    def look(self):
        """The group's open files by name, looked up again if a second has passed."""
        if time.monotonic() > self.looked + 1.0:
            self.looked = time.monotonic()
            folder = self.fixed or group_folder()
            if folder != self.folder:
                for file in self.files.values():
                    file.close()
                self.folder, self.files = folder, {}
                for name in self.NAMES if folder else ():
                    try:
                        self.files[name] = CounterFile(os.path.join(folder, name))
                    except OSError:
                        pass
        return self.files


def group_folder():
    """The folder of this process's own CPU cgroup (v1's cpu controller, else v2's) if it has a
    cpu.stat, or None."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.strip().split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in sorted(lines, key=lambda line: line[1] == ""):  # v1 first
        if "cpu" in controllers.split(",") or controllers == "":
            root = f"/sys/fs/cgroup/{controllers}" if controllers else "/sys/fs/cgroup"
            folder = os.path.join(root, path.lstrip("/"))
            if os.path.exists(os.path.join(folder, "cpu.stat")):
                return folder
    return None
