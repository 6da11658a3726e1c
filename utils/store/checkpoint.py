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

    save(state.state_dict(...), path)                    rank 0 (utils.learn.state.TrainingState builds it)
    checkpoint = load(path, expected_settings)           checked, or one UsageError line
    finished(checkpoint, epochs)                         the end of a run: nothing left to train

The training state restores it (TrainingState.load_state_dict). Checkpoints, state dicts and
every other output are written by utils.store.files.write_file (atomic
for a regular file, through a symlink, in place for a device or FIFO).
"""

import io
import os
import pickle
import re
import warnings

import torch

from utils.errors import UsageError
from utils.store.files import write_file

SCHEMA = {"model", "optimizer", "scheduler", "rng", "epoch", "step", "epoch_stats", "settings"}  # required keys


def save(state, path):
    """torch.save `state` to `path` (see write_file)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_file(path, buffer.getvalue())


def save_model(model, path):
    """The model's state dict alone, what --model_path and --eval read (after every epoch)."""
    save(model.state_dict(), path)


def upgrade(checkpoint):
    """(the settings a resume must keep, the world size) of a checkpoint; older ones held the world
    size and the batch per rank as settings, and no compression."""
    settings = {"compress": "none", **checkpoint["settings"]}
    world_size = checkpoint.get("world_size", settings.pop("world-size", None))
    if "batch-size" in settings:
        settings["global-batch"] = settings.pop("batch-size") * world_size
    return settings, world_size


def load(path, expected):
    """The checkpoint at `path`, checked against this run's settings `expected` ({flag: value}).

    It may have been made on another number of ranks: the steps, the data order and the schedule
    follow from the global batch, which must match (utils.learn.data.step_batches)."""
    checkpoint = safe_load(path, "checkpoint")
    if not isinstance(checkpoint, dict) or not SCHEMA <= set(checkpoint):
        raise UsageError(f"checkpoint {path} is not a training checkpoint of this program")
    for name, value in upgrade(checkpoint)[0].items():
        if expected.get(name) != value:
            raise UsageError(
                f"checkpoint {path} was made with --{name} {value}, this run has "
                f"{expected.get(name)}; resume with the same settings, or start afresh without --resume"
            )
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
        detail = (
            f"missing {missing[:3]}"
            if missing
            else f"unexpected {unexpected[:3]}"
            if unexpected
            else f"{wrong[0]} has shape {tuple(state[wrong[0]].shape)}, expected {tuple(expected[wrong[0]].shape)}"
        )
        raise UsageError(f"model file {path} is for a different architecture ({detail})")
    model.load_state_dict(state)
