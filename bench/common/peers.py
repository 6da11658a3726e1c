"""What the two training benchmarks (train_step.py, time_to_accuracy.py) measure ours against: torch
DDP with its compression hooks, torch's post-local SGD, and a step that sums nothing (compute only);
and the NIC's byte counter they both read. Every one of them runs through the trainer's own loop
(train_steps) in the place of our gradient sync, so they differ in nothing but the sum.
"""

from __future__ import annotations

from pathlib import Path

import harness  # noqa: F401  # the repository on the path (the benchmarks are run directly)

from utils.comm.allreduce import ALGORITHMS
from utils.comm.compress import NoCompression
from utils.sync.interface import GradientSync
from utils.timeline import OFF

DDP_HOOKS = ("fp16", "bf16", "powersgd")  # DDP + default_hooks.fp16/bf16_compress_hook, + powerSGD_hook


def parse_ours(text: str) -> dict:
    """One of our configurations, '<algorithm>[+overlap[+lazy]]' ("ring+overlap+lazy") -> its
    settings {allreduce, overlap, lazy_update}; ValueError for anything else."""
    alg, *flags = text.split("+")
    if alg not in ALGORITHMS or flags not in ([], ["overlap"], ["overlap", "lazy"]):
        raise ValueError(
            f"expected <algorithm>[+overlap[+lazy]] with algorithm one of {', '.join(ALGORITHMS)}, got {text!r}"
        )
    return {"allreduce": alg, "overlap": "overlap" in flags, "lazy_update": "lazy" in flags}


def our_sync(allreduce, overlap, lazy_update, compress="none", powersgd_rank=None, powersgd_warmup=None, **settings):
    """The utils.setup.config.Sync of one of our configurations, as train.py would build it from its flags
    (PowerSGD's rank and warm-up only with compress="powersgd"). overlap=False is the plain
    "<algorithm>": backward, then the whole sum. settings: the Sync's timeout, chunks and bucket_mb
    (train.py's defaults), and sync_every.

    sync_every=H > 1: H local steps, then the parameters' change averaged (utils/sync/periodic.py), with
    the outer step `outer` (default average); outer_lr and outer_momentum only for "nesterov", and
    merge_after (None: train.py's defaults). There is no per-step sum to make lazy, so lazy_update is off,
    as train.py requires. With sync_every=1 the outer settings are dropped: the Sync is exactly the per-step one."""
    from utils.comm.names import DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM
    from utils.setup.config import Sync, default_merge_after

    settings = {"timeout": 120.0, "chunks": "auto", "bucket_mb": 1.0, "sync_every": 1, **settings}
    outer = {"outer": "average", "outer_lr": None, "outer_momentum": None, "merge_after": None}
    outer |= {key: settings.pop(key) for key in outer if key in settings}
    every, powersgd = settings["sync_every"], compress == "powersgd"
    if every > 1:
        nesterov = outer["outer"] == "nesterov"
        outer_lr = DEFAULT_OUTER_LR if outer["outer_lr"] is None else outer["outer_lr"]
        outer_momentum = DEFAULT_OUTER_MOMENTUM if outer["outer_momentum"] is None else outer["outer_momentum"]
        settings |= {"outer": outer["outer"], "merge_after": outer["merge_after"] or default_merge_after(every)}
        settings |= {"outer_lr": outer_lr if nesterov else None, "outer_momentum": outer_momentum if nesterov else None}
    else:
        del settings["sync_every"]  # exactly the per-step Sync
    if not powersgd:  # PowerSGD's rank and warm-up mean nothing to the other compressions
        powersgd_rank = powersgd_warmup = None
    settings |= dict(allreduce=allreduce, overlap=overlap, lazy_update=lazy_update and every == 1, compress=compress)
    return Sync(powersgd_rank=powersgd_rank, powersgd_warmup=powersgd_warmup, **settings)


class LocalStep(GradientSync):
    """A gradient sync that sums nothing: the optimizer step alone, as the trainer's syncs take it.
    Compute only uses it, DDP, which has summed during backward already, and local SGD (whose
    optimizer averages the parameters). at_end: what flush() does at the end of training. Nothing
    it does counts as communication, and counts_bytes says so (bytes_sent)."""

    counts_bytes = False
    has_rank_state = False

    def __init__(self, optimizer, scheduler, at_end=lambda: None):
        super().__init__(optimizer, scheduler, NoCompression(), OFF)
        self.at_end = at_end

    def sum(self):
        pass

    def flush(self):
        self.at_end()

    def stats(self):
        return dict.fromkeys(("busy_seconds", "waited_seconds", "bytes_sent", "bytes_summed"), 0)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    def abandon(self):
        return False


def train_steps(model, sync, images, labels, batches, epoch=1, first_step=0, recorder=None):
    """utils.run.train_steps, the trainer's own loop, over batches[first_step:] (utils.learn.training.batches_of_epoch's
    (batch, weight, size) items) with `sync` in the place of its gradient sync; `recorder` (a
    utils.timeline.Recorder, or None: off) records its spans. Returns its EpochStats (the loss
    summed over the steps)."""
    from types import SimpleNamespace

    from utils.learn.callbacks import Callbacks, StepProbe, TimelineWindow
    from utils.learn.state import Position, TrainingState
    from utils.run import train_steps
    from utils.sync.interface import DistributedOptimizer

    timeline = recorder or OFF
    state = TrainingState(model, sync.base_optimizer, sync.scheduler)
    state.attach(sync)
    state.position = Position(epoch, first_step)
    callbacks = Callbacks(TimelineWindow(timeline, len(batches)), probe=StepProbe(timeline))
    trainer = SimpleNamespace(
        model=model, state=state, sync=sync, optimizer=DistributedOptimizer(sync), data=(images, labels),
        batches=lambda _: batches, callbacks=callbacks,
    )  # fmt: skip
    train_steps(trainer)
    state.settle()  # (what the epoch's end does: a lazy update still due is applied)
    return state.stats


def make_ddp(model, hook: str | None = None, powersgd_rank: int = 4, powersgd_warmup: int = 2, seed: int = 0):
    """torch DDP (gloo) around `model`, with one of its compression comm hooks (None: plain DDP).

    "powersgd" runs with the whole gradient in ONE bucket: over gloo, DDP's powerSGD_hook aborts
    ("Received data size doesn't match expected size") when the model has two buckets, whose P/Q
    all-reduce chains can start in different orders on different ranks. So both the first-bucket
    cap (dist._DEFAULT_FIRST_BUCKET_BYTES, read by older torch) and bucket_cap_mb go above the
    gradient's size. PowerSGDState: rank `powersgd_rank`, plain all-reduce for the first
    `powersgd_warmup` steps (torch needs >= 2 with error feedback / warm start, its defaults).
    Returns (ddp_module, hook_state or None)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook not in (None, *DDP_HOOKS):
        raise ValueError(f"unknown DDP hook {hook!r}")
    kwargs = {}
    if hook == "powersgd":
        grad_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        dist._DEFAULT_FIRST_BUCKET_BYTES = int((grad_mb + 1) * 2**20)
        kwargs["bucket_cap_mb"] = grad_mb + 1
    ddp = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
    state = None
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        rank, start = powersgd_rank, max(2, powersgd_warmup)
        state = powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=rank, start_powerSGD_iter=start, random_seed=seed
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp, state


def make_localsgd(model, optimizer, period: int, warmup: int):
    """torch's post-local SGD around `model`, as its docs put it together: DDP with post_localSGD_hook
    (post_local_gradient_allreduce=False: after `warmup` steps of DDP's all-reduce, no gradient is
    summed at all) and PostLocalSGDOptimizer, which after each step of `optimizer` (the inner Adam)
    lets a PeriodicModelAverager average the parameters: at step `warmup` and every `period` steps
    after it, a blocking float32 all-reduce of the whole model.

    The one-cycle scheduler stays on the inner optimizer: the wrapper has no param_groups of its own
    but the inner one's, so the rates the scheduler sets are the ones the inner step reads (checked
    here: a torch where the wrapper copied them would train at the first rate throughout).
    Returns (ddp_module, wrapped_optimizer)."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook
    from torch.distributed.algorithms.model_averaging import averagers
    from torch.distributed.optim import PostLocalSGDOptimizer

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = post_localSGD_hook.PostLocalSGDState(
        process_group=None, subgroup=None, start_localSGD_iter=warmup, post_local_gradient_allreduce=False
    )
    ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
    wrapped = PostLocalSGDOptimizer(
        optim=optimizer, averager=averagers.PeriodicModelAverager(period=period, warmup_steps=warmup)
    )
    if wrapped.param_groups is not optimizer.param_groups:
        raise RuntimeError(
            "PostLocalSGDOptimizer does not share the inner optimizer's param_groups: "
            "the scheduler's learning rates would not reach it"
        )
    return ddp, wrapped


def average_parameters(model) -> None:
    """Every rank's parameters replaced by their mean over the ranks: one float32 all-reduce of the
    whole model (the same bits on every rank). Local SGD's end, where the ranks have taken steps
    of their own since the last average."""
    import torch
    import torch.distributed as dist

    params = list(model.parameters())
    with torch.no_grad():
        flat = torch.cat([p.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
        for p, part in zip(params, torch.split(flat, [p.numel() for p in params])):
            p.copy_(part.view_as(p))


def bytes_sent(gradient_sync) -> int | None:
    """Bytes this rank has sent for gradient sums so far (utils.sync.buckets's stats()), or None where
    nothing counts them (LocalStep: compute only, DDP, local SGD)."""
    return gradient_sync.stats()["bytes_sent"] if getattr(gradient_sync, "counts_bytes", True) else None


def nic_tx_bytes(nic: str | None) -> int | None:
    """Bytes this network namespace has sent on `nic` so far (/proc/self/net/dev), or None (no such NIC,
    or loopback, where every rank's traffic shares one counter)."""
    if not nic or nic == "lo":
        return None
    try:
        for line in Path("/proc/self/net/dev").read_text().splitlines()[2:]:
            name, _, fields = line.partition(":")
            if name.strip() == nic:
                return int(fields.split()[8])
    except (OSError, ValueError, IndexError):
        pass
    return None
