"""One output folder, one job: rank 0 holds a lock beside every file it writes.

The lock is an advisory flock on `<output>.lock`, taken by the process itself. The kernel drops
it when that process ends in any way, SIGKILL included, so a killed job leaves nothing to clean
up by hand: the next job takes the lock file over. A job that ends by itself (done, stopped, a
lost peer, bad input) removes its lock files (release()). It unlinks each while still holding
its lock, and a taker checks, once locked, that the file it locked is still the one at that
path (else it opens the new one): so two jobs never each hold a lock on a different file of the
same name. Devices and FIFOs (--save-path /dev/null) get no lock file: nothing is left beside them.
"""

import fcntl
import os
import socket
import time

from utils.errors import UsageError
from utils.store.files import special_kind

PROBE_SECONDS = 0.5  # a lock taken for longer than another job's look (hold=False) is a job's
_held = []  # the open lock files of this process: closing one would release its lock


def lock_outputs(outputs, hold=True, take_from=()):
    """Lock every output of this job, or stop in one line naming the job that has them.

    take_from: what holder() says of processes whose locks this one may take over (a job whose
    rank 0 was lost and is frozen, not dead, still holds them: utils/elastic/recovery.py).

    hold=False only looks (the local launcher, before it starts the rank 0 that will take the
    locks; a resumed run that is already finished, which writes nothing): it takes each lock and
    gives it back at once, and creates no file.
    """
    taken = []
    try:
        for option, path in outputs.files():
            if special_kind(os.path.realpath(path)) is not None:
                continue  # a device or FIFO: written in place, by whoever names it
            lock_path = os.path.realpath(path) + ".lock"
            if not hold and not os.path.exists(lock_path):
                continue  # every holder creates its lock file first: nobody holds this one
            try:
                fd, locked = open_and_lock(lock_path, hold)
                if not locked and holder(fd) in take_from:  # ours: remove it, so a new file is locked
                    if same_file(fd, lock_path):
                        os.unlink(lock_path)
                    os.close(fd)
                    fd, locked = open_and_lock(lock_path, hold)
                taken.append((fd, lock_path))
                if locked and hold:  # in place, not by rename: a new file would not be the one that is locked
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"pid {job_pid()} on {socket.gethostname()}\n".encode(), 0)
            except OSError as e:  # another user's lock file, a filesystem without locks (ENOLCK), ...
                raise UsageError(f"cannot lock {option} {path} ({lock_path}): {e.strerror or e}") from None
            if not locked:
                raise UsageError(
                    f"{option} {path} is in use by another job ({holder(fd)}); let it finish, or give "
                    f"this job other files with --save-path, --checkpoint, --metrics and --timeline"
                )
    except BaseException:
        for fd, _ in taken:
            os.close(fd)
        raise
    if hold:
        _held.extend(taken)
    else:
        for fd, _ in taken:
            os.close(fd)


def open_and_lock(lock_path, hold):
    """(fd, locked) of the lock file at `lock_path`; a file its holder removed meanwhile is
    left for the one now at that path."""
    while True:
        try:
            fd = os.open(lock_path, (os.O_RDWR | os.O_CREAT) if hold else os.O_RDONLY, 0o666)
        except FileNotFoundError:  # only a look opens without creating: the holder just released it
            return os.open(os.devnull, os.O_RDONLY), True
        locked = try_lock(fd, patience=PROBE_SECONDS if hold else 0, shared=not hold)
        if not locked or same_file(fd, lock_path):
            return fd, locked
        os.close(fd)  # locked a file that is gone: its holder released it just now


def same_file(fd, path):
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def release():
    """Remove this process's lock files and let go of their locks (the end of a job)."""
    while _held:
        fd, lock_path = _held.pop()
        try:
            if same_file(fd, lock_path):
                os.unlink(lock_path)
        finally:
            os.close(fd)


def try_lock(fd, patience, shared=False):
    """flock(LOCK_EX) without blocking; retried for `patience` seconds. shared: LOCK_SH, which a look
    takes: it meets a holder's LOCK_EX all the same, and an NFS client grants it on a file opened
    read-only (LOCK_EX there fails with EBADF: a job left a lock file could not start again)."""
    deadline = time.monotonic() + patience
    kind = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def job_pid(handoff=None):
    """The pid that stands for this job: the local launcher's, when it started this rank (its
    handoff says so: utils/setup/handoff.py; None: this process's own)."""
    from utils.setup.handoff import Handoff

    return (Handoff.from_environ() if handoff is None else handoff).job_pid or os.getpid()


def holder(fd):
    """What the lock file says about the job that holds it."""
    text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    return text or "it has not yet written its pid"  # it took the lock a moment ago
