"""Every file the program writes, written one way (write_file), and the checks before a run.

A regular file, or one not there yet, is written atomically: a temp file in the same folder,
fsync, rename, so a crash leaves the old file or the new one, never a mix. A symlink is written
through to its target, whose folder gets the temp file; the link stays. A character or block
device or a FIFO is written in place (/dev/null, a pipe to another program); a socket or a
folder is refused in one line. A write that fails (a full disk, /dev/full) is one UsageError line.

No torch here: the local launcher checks the outputs, and a bad command line is answered, before
torch is loaded (it takes a rank a second or two to import).
"""

import os
import stat
import tempfile

from utils.errors import UsageError


def write_file(path, data, private=False):
    """Write bytes to `path`: atomically for a regular file, through a symlink, in place for a
    device or FIFO (see the module's docstring). A write that fails (a full disk, /dev/full) is
    one UsageError line. private: a new regular file readable by its user only (a key)."""
    target = os.path.realpath(path)
    kind = special_kind(target)
    if kind not in (None, "device", "FIFO"):
        raise UsageError(f"cannot write {path}: it is a {kind}")
    try:
        if kind is None:
            _atomic_write(target, data, private)
        else:
            with open(target, "wb") as f:
                f.write(data)
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None


def special_kind(path):
    """None for a regular file or one not there yet; else 'device', 'FIFO', 'folder', 'socket'."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "FIFO" if stat.S_ISFIFO(mode) else "folder" if stat.S_ISDIR(mode) else "socket"


def _atomic_write(path, data, private=False):
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        if not private:  # mkstemp makes 0600; give it a normal file's mode
            os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def check_writable(path, option):
    """Fail now, in one line, if `path` cannot be written: not after an epoch of training."""
    target = os.path.realpath(path)
    kind = special_kind(target)
    if kind == "folder":
        raise UsageError(f"{option} {path} is a folder; give a file name in it")
    if kind == "socket":
        raise UsageError(f"{option} {path} is a socket; give a file, a device or a FIFO")
    if kind is not None:
        if not os.access(target, os.W_OK):
            raise UsageError(f"cannot write {option} {path}: permission denied")
        return
    folder = os.path.dirname(target)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"cannot write {option} {path}: {e.strerror or e}") from None


def check_folder(path, option):
    """A folder the job writes files in (--tensorboard): made if need be; fail now, in one line, if
    it cannot be written."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"cannot write {option} {path}: {e.strerror or e}") from None


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def remove_stale_temps(path):
    """Delete temp files that a save killed half-way left next to `path` (its target's folder)."""
    target = os.path.realpath(path)
    folder = os.path.dirname(target)
    if special_kind(target) is None and os.path.isdir(folder):
        prefix = os.path.basename(target) + "."
        for name in os.listdir(folder):
            if name.startswith(prefix) and name.endswith(".tmp"):
                os.remove(os.path.join(folder, name))


def set_aside(path):
    """A fresh start keeps the previous run's checkpoint as <path>.prev (through a symlink: its
    target's); returns whether there was one. A device or FIFO is left alone."""
    target = os.path.realpath(path)
    if not os.path.isfile(target):
        return False
    os.replace(target, target + ".prev")
    return True
