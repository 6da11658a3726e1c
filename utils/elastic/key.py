"""The job's key: what signs every control message (utils/elastic/wire.py).

Where it comes from, first found first:

    --key-file PATH      the same file on every server, like munge's key (at least 16 bytes)
    $RING_KEY_FILE       the same, from the environment
    $RING_JOB_KEY        the key itself (scripts/slurm.sbatch makes one per job; torchrun passes it on)
    none of these        rank 0 makes a random one at start and sends it to every rank over the
                         first rendezvous; each keeps a copy, readable by its user only, at
                         CHECKPOINT.key, where a server restarted with --join on that machine
                         finds it by itself (a new server is given the file: --key-file)

The key is read and written as text: the bytes of the file, without surrounding whitespace.
"""

import os
import stat

from utils.errors import UsageError
from utils.store.files import special_kind, write_file

MIN_BYTES = 16


def given(key_file, environ=os.environ):
    """The key the user gave (bytes), or None; a UsageError line for a file that will not do."""
    path = key_file or environ.get("RING_KEY_FILE")
    if path:
        return read(path, "--key-file" if key_file else "$RING_KEY_FILE")
    if environ.get("RING_JOB_KEY"):
        return checked(environ["RING_JOB_KEY"].strip().encode(), "$RING_JOB_KEY")
    return None


def read(path, where):
    try:
        mode = os.stat(path).st_mode
        with open(path, "rb") as f:
            key = f.read(4096).strip()
    except OSError as e:
        raise UsageError(f"cannot read {where} {path}: {e.strerror or e}") from None
    if stat.S_ISREG(mode) and mode & 0o077:
        raise UsageError(f"{where} {path} can be read by other users; make it yours alone: chmod 600 {path}")
    return checked(key, f"{where} {path}")


def checked(key, where):
    if len(key) < MIN_BYTES:
        raise UsageError(
            f"{where} holds {len(key)} bytes; a key needs at least {MIN_BYTES} (e.g. 64 random hex digits)"
        )
    return key


def new():
    return os.urandom(32).hex().encode()


def copy_path(checkpoint):
    return checkpoint + ".key"


def keep(key, checkpoint):
    """This server's copy of a key rank 0 made, beside its checkpoint (for a later --join here).
    None when the checkpoint is a device or a FIFO (nothing is written beside /dev/null); else the path."""
    if special_kind(os.path.realpath(checkpoint)) is not None:
        return None
    write_file(copy_path(checkpoint), key + b"\n", private=True)
    return copy_path(checkpoint)


def for_joining(key_file, checkpoint, environ=os.environ):
    """A server that joins: the key it was given, else the copy a run of the job left here."""
    key = given(key_file, environ)
    if key is not None:
        return key
    if os.path.exists(copy_path(checkpoint)):
        return read(copy_path(checkpoint), "the job's key")
    raise UsageError(
        f"no key for the job's control messages: give --key-file PATH, a copy of {copy_path(checkpoint)} "
        f"from any server of the job (or set $RING_JOB_KEY as the job did)"
    )
