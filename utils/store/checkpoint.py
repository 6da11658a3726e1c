"""The checkpoint's owner, and every file the program writes.

A checkpoint is a plain dict (SCHEMA), written by rank 0 after an epoch, every --save-every steps
and on a stop; it holds everything to continue exactly after `step` of `epoch`, on this number of
ranks or another:

    model, optimizer, scheduler, rng     the state dicts, and torch's random state
    epoch, step                          continue after this step (step 0: at the epoch's start)
    epoch_stats                          the epoch's log-line sums so far (utils.learn.state.EpochStats)
    world_size                           the ranks it was made on
    compression                          every rank's compression state (None: uncompressed)
    settings                             {flag: value} a resume must keep (Config.must_keep + model)
    config                               the whole utils.setup.config.Config, for the record
    balance                              --balance's weights of the ranks' shares (None: equal)
    digest                               the sha256 of all the above (digest): checked before any use

    save(state.state_dict(...), path)                    rank 0 (utils.learn.state.TrainingState builds it)
    checkpoint = load(path, expected_settings)           checked, or one UsageError line
    finished(checkpoint, epochs)                         the end of a run: nothing left to train
    save_model(model, path); load_model_state(model, path)   the model file and its digest beside it
    not_finite(state)                                    the first non-finite tensor's name, or None

Nothing read back is trusted blindly. A checkpoint carries a digest of its contents, as TensorFlow's
keeps a CRC32C of every tensor: a sha256 over every tensor's dtype, shape and bytes and every other
value, walked in a fixed order (digest), checked right after torch.load, before anything uses it. The
model file stays a plain state dict that plain torch loads; its digest is a file beside it,
`<file>.sha256` in sha256sum's format (`sha256sum -c` checks it too). A mismatch is one Damaged
line (exit 2) and nothing is loaded; a file without a digest (an older checkpoint, a model from
elsewhere) loads, with one line that says it could not be checked. Nothing non-finite is saved:
utils.learn.training.Checkpointer asks not_finite first.

The training state restores it (TrainingState.load_state_dict). Checkpoints, state dicts and
every other output are written by utils.store.files.write_file (atomic
for a regular file, through a symlink, in place for a device or FIFO).
"""

import hashlib
import io
import os
import pickle
import re
import sys
import warnings

import torch

from utils.errors import Damaged, UsageError
from utils.store.files import special_kind, write_file

SCHEMA = {"model", "optimizer", "scheduler", "rng", "epoch", "step", "epoch_stats", "settings"}  # required keys


DIGEST = "digest"  # the checkpoint's key that holds the sha256 of the rest of it
SIDECAR = ".sha256"  # a model file's digest: beside it, this added to its name


def save(state, path):
    """torch.save `state` to `path` (see write_file), with its digest."""
    _write(dict(state, **{DIGEST: digest(state)}), path)


def _write(value, path):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    write_file(path, buffer.getvalue())
    return buffer.getvalue()


def save_model(model, path):
    """The model's state dict alone, what --model_path and --eval read (after every epoch), and its
    digest beside it (sidecar): the old digest goes first, then the model and its new digest are each
    written atomically, so a crash between leaves a model without a digest (it loads, unchecked),
    never a model with another's digest. A device or a FIFO (--save-path /dev/null) gets none."""
    beside = sidecar(path)
    try:
        if beside is not None and os.path.lexists(beside):
            os.remove(beside)
    except OSError as e:  # (a folder of that name, a folder not writable)
        raise UsageError(f"cannot write {beside}: {e.strerror or e}") from None
    data = _write(model.state_dict(), path)
    if beside is not None:
        name = os.path.basename(beside[: -len(SIDECAR)])
        write_file(beside, f"{hashlib.sha256(data).hexdigest()}  {name}\n".encode())


def sidecar(path):
    """Where the digest of the model file `path` is (beside its target, if a symlink); None for a
    device or a FIFO."""
    target = os.path.realpath(path)
    return None if special_kind(target) is not None else target + SIDECAR


def digest(value):
    """The sha256 (hex) of a checkpoint's contents: every tensor's dtype, shape and bytes (in its
    logical order, whatever its memory layout), every other value's type and repr, dicts in the
    order of their keys; what torch.save writes and torch.load gives back has the same digest."""
    hashed = hashlib.sha256()
    _feed(hashed, value)
    return hashed.hexdigest()


def _feed(hashed, value):
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        hashed.update(f"tensor {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        hashed.update(tensor.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, dict):
        hashed.update(f"dict {len(value)}\n".encode())
        for key in sorted(value, key=lambda k: (type(k).__name__, repr(k))):
            _feed(hashed, key)
            _feed(hashed, value[key])
    elif isinstance(value, (list, tuple)):
        hashed.update(f"{type(value).__name__} {len(value)}\n".encode())
        for item in value:
            _feed(hashed, item)
    else:
        hashed.update(f"{type(value).__name__} {value!r}\n".encode())


def not_finite(value, name="state"):
    """The name of the first floating tensor in `value` (dicts and lists of them) that holds a NaN or
    an inf ("state.model.fc2.bias"), or None: a scan of every value, for a save, not for a step."""
    if isinstance(value, torch.Tensor):
        return name if value.is_floating_point() and not bool(torch.isfinite(value).all()) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = not_finite(item, f"{name}.{key}")
        if found is not None:
            return found
    return None


def unchecked(line):
    """A file read without a digest to check it by: one line, and it loads."""
    print(f"warning: {line}", file=sys.stderr, flush=True)


def check_digest(checkpoint, path):
    """Pop the digest `checkpoint` (read from `path`) carries and compare it with its contents':
    Damaged (one line) if they differ. Returns whether it had one (a checkpoint older than digests not)."""
    stored = checkpoint.pop(DIGEST, None)
    if stored is None:
        return False
    found = digest(checkpoint)
    if stored != found:
        raise Damaged(
            f"checkpoint {path} is damaged: its digest says sha256 {str(stored)[:16]}…, its contents give "
            f"{found[:16]}…; nothing was loaded or overwritten: resume from a good copy, or start afresh "
            f"without --resume"
        )
    return True


def check_model_file(path):
    """Compare the model file at `path` with its digest beside it (sidecar): Damaged (one line) if they
    differ. Returns whether there was one to check (a path that is no regular file: safe_load says why)."""
    beside = sidecar(path)
    if beside is None or not os.path.isfile(path) or not os.path.exists(beside):
        return False
    with open(beside, "rb") as f:
        stored = f.read(200).split(b" ", 1)[0].decode(errors="replace").strip().lower()
    if not re.fullmatch(r"[0-9a-f]{64}", stored):
        raise Damaged(f"digest file {beside} is not a sha256sum line (<64 hex digits>  <name>); delete it, or mend it")
    with open(path, "rb") as f:
        found = hashlib.file_digest(f, "sha256").hexdigest()
    if stored != found:
        raise Damaged(
            f"model file {path} does not match its digest: {beside} says sha256 {stored[:16]}…, the file's is "
            f"{found[:16]}…; it is damaged or was changed: nothing was loaded (use a good copy, or delete "
            f"the .sha256 to load it unchecked)"
        )
    return True


def upgrade(checkpoint):
    """(the settings a resume must keep, the world size) of a checkpoint; older ones held the world
    size and the batch per rank as settings, and no compression."""
    settings = {"compress": "none", **checkpoint["settings"]}
    world_size = checkpoint.get("world_size", settings.pop("world-size", None))
    if "batch-size" in settings:
        settings["global-batch"] = settings.pop("batch-size") * world_size
    return settings, world_size


def load(path, expected, quiet=False):
    """The checkpoint at `path`, its digest checked (Damaged), then against this run's settings
    `expected` ({flag: value}). quiet: no line for a checkpoint without a digest (it is read again).

    It may have been made on another number of ranks: the steps, the data order and the schedule
    follow from the global batch, which must match (utils.learn.data.step_batches)."""
    checkpoint = safe_load(path, "checkpoint")
    if not isinstance(checkpoint, dict) or not SCHEMA <= set(checkpoint):
        raise UsageError(f"checkpoint {path} is not a training checkpoint of this program")
    checked = check_digest(checkpoint, path)
    for name, value in upgrade(checkpoint)[0].items():
        if expected.get(name) != value:
            raise UsageError(
                f"checkpoint {path} was made with --{name} {value}, this run has "
                f"{expected.get(name)}; resume with the same settings, or start afresh without --resume"
            )
    if not (checked or quiet):
        unchecked(f"checkpoint {path} has no digest (it is older than digests): it could not be checked")
    return checkpoint


def finished(checkpoint, epochs):
    """Whether `checkpoint` is the end of a run: every epoch done, nothing left to train."""
    return checkpoint is not None and checkpoint["epoch"] > epochs and checkpoint["step"] == 0


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
        raise UsageError(
            f"{what} {path} was refused by the weights-only loader: it holds more than tensors"
            f"{f' ({reason.group(0)})' if reason else ''}; load only files you trust"
        ) from None
    except Exception as e:  # random bytes reach the legacy unpickler, which can fail in any way at all
        detail = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise UsageError(f"{what} {path} is not a readable PyTorch file (truncated or corrupt: {detail})") from None


def load_model_state(model, path, quiet=False):
    """Load a state dict saved by this program into `model`, or explain in one line why not: its
    digest is checked first (a model file's beside it, a checkpoint's inside). quiet: no line for a
    file without a digest (the local launcher's look before its rank 0 loads it)."""
    checked = check_model_file(path)
    state = safe_load(path, "model file")
    without = f"model file {path} has no digest beside it ({sidecar(path)})"
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        checked = check_digest(state, path) or checked  # a full training checkpoint also carries the model
        state, without = state["model"], f"checkpoint {path} has no digest (it is older than digests)"
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UsageError(f"model file {path} does not hold a state dict (it holds a {type(state).__name__})")
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        detail = (
            f"missing {missing[:3]}"
            if missing
            else f"unexpected {unexpected[:3]}"
            if unexpected
            else f"{wrong[0]} has shape {tuple(state[wrong[0]].shape)}, expected {tuple(expected[wrong[0]].shape)}"
        )
        raise UsageError(f"model file {path} is for a different architecture ({detail})")
    if not (checked or quiet):  # (said once it loads: a file refused is one line)
        unchecked(f"{without}: it could not be checked")
    model.load_state_dict(state)
