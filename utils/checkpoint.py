"""Saving without ever leaving half a file, and loading only what is safe to load."""
import io
import os
import pickle
import re
import tempfile
import warnings

import torch

from utils.errors import UsageError


def atomic_write(path, data):
    """Write bytes to a temp file in the same folder, fsync, then rename over `path`.

    A crash at any moment leaves either the old file or the new one, never a mix.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp makes 0600; give it a normal file's mode
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
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{option} {path} is a folder; give a file name in it")
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"cannot write {option} {path}: {e.strerror or e}") from None


def atomic_save(obj, path):
    """torch.save `obj` to `path` atomically (see atomic_write)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write(path, buffer.getvalue())


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def remove_stale_temps(path):
    """Delete temp files that a save killed half-way left next to `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(folder):
        prefix = os.path.basename(path) + "."
        for name in os.listdir(folder):
            if name.startswith(prefix) and name.endswith(".tmp"):
                os.remove(os.path.join(folder, name))


def safe_load(path, what="file"):
    """torch.load with weights_only=True; every way it can fail becomes one UsageError line."""
    if not os.path.exists(path):
        raise UsageError(f"{what} {path} does not exist")
    if not os.path.isfile(path):
        raise UsageError(f"{what} {path} is not a file")
    if os.path.getsize(path) == 0:
        raise UsageError(f"{what} {path} is empty")
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols; the error below says enough
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = re.search(r"Unsupported [^\n.]*", str(e))
        raise UsageError(f"{what} {path} was refused by the weights-only loader: it holds more than tensors"
                         f"{f' ({reason.group(0)})' if reason else ''}; load only files you trust")
    except Exception as e:  # random bytes reach the legacy unpickler, which can fail in any way at all
        detail = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise UsageError(f"{what} {path} is not a readable PyTorch file (truncated or corrupt: {detail})")


def load_model_state(model, path):
    """Load a state dict saved by this program into `model`, or explain in one line why not."""
    state = safe_load(path, "model file")
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]  # a full training checkpoint also carries the model
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UsageError(f"model file {path} does not hold a state dict (it holds a {type(state).__name__})")
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        detail = (f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}" if unexpected
                  else f"{wrong[0]} has shape {tuple(state[wrong[0]].shape)}, expected {tuple(expected[wrong[0]].shape)}")
        raise UsageError(f"model file {path} is for a different architecture ({detail})")
    model.load_state_dict(state)
