"""bench/time_to_accuracy/time_to_accuracy.py's ranks: one configuration trained from scratch with the trainer's recipe,
the clock paused at every evaluation.

The trainer's own loop (peers.train_steps) runs one segment between evaluation points at a time and
ends it with the sync's finish(). At the end of training the sync's flush() also makes every rank's
parameters the same (ours@H: the rounds in flight applied; local SGD: one more average), as
train.py's end does, on the clock. At the other points, with @H, rank 0's model is evaluated as it
stands between syncs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from harness import REPO, digest, end_worker, pick, start_worker
from peers import (
    LocalStep,
    average_parameters,
    bytes_sent,
    make_ddp,
    make_localsgd,
    nic_tx_bytes,
    our_sync,
    train_steps,
)

from utils.learn.model import Net
from utils.store.files import write_file


def eval_steps(steps_per_epoch: int, evals_per_epoch: int) -> list[int]:
    """The steps within an epoch (1-based) after which to evaluate: evenly spaced, the last one always
    the epoch's end, none twice."""
    k = max(1, min(evals_per_epoch, steps_per_epoch))
    return sorted({max(1, round(steps_per_epoch * i / k)) for i in range(1, k + 1)})


class eval_cache(dict):
    """Test accuracy by the model's sha256 (and test-set size), kept in a JSON file across worlds and
    runs: the repeats of a deterministic configuration, and the same configuration on another link,
    train the very same bits, so each model is evaluated once. None: no file, nothing kept."""

    def __init__(self, path):
        self.path = Path(path) if path else None
        super().__init__(json.loads(self.path.read_text()) if self.path and self.path.exists() else {})

    def save(self):
        if self.path:
            write_file(self.path, json.dumps(self, sort_keys=True).encode())


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    from utils.exchange import all_gather_json
    from utils.learn.data import load_mnist
    from utils.learn.training import batches_of_epoch
    from utils.setup.config import Recipe

    cfg, say = start_worker(args)
    rank, n, spec = args.rank, cfg["world_size"], cfg["spec"]
    prefix = f"  [{cfg['label']} N={n} {spec['name']}]"
    train_images, train_labels, test_images, test_labels = load_mnist(str(REPO / "data"))
    train, test = slice(cfg["train_subset"]), slice(cfg["test_subset"])  # (None: all)
    data = (train_images[train], train_labels[train], test_images[test], test_labels[test])
    batch = max(1, cfg["global_batch"] // n)
    recipe = Recipe(batch_size=batch, **pick(cfg, "global_batch lr seed epochs train_subset test_subset"))
    steps_per_epoch = len(batches_of_epoch(len(data[1]), 1, recipe))
    compute_s = max_over_ranks(time_compute(cfg, recipe, data, steps_per_epoch))
    torch.manual_seed(cfg["seed"])
    model = Net()
    forward, sync = make_run_sync(cfg, model, recipe, steps_per_epoch)
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    compute = f"compute only {compute_s * 1e3:.1f} ms/step (GLOO_SOCKET_IFNAME={ifname or '-'})"
    say(f"{prefix} {n} ranks up, batch {recipe.batch_size}/rank, {steps_per_epoch} steps/epoch, {compute}")
    run = Run(model, data[2:], steps_per_epoch, cfg.get("eval_cache"), say if rank == 0 else None, prefix)
    counts = [nic_tx_bytes(ifname), bytes_sent(sync)]
    run.evaluate(0)
    at = eval_steps(steps_per_epoch, cfg["evals_per_epoch"])
    for epoch in range(1, cfg["epochs"] + 1):
        batches = batches_of_epoch(len(data[1]), epoch, recipe)
        for first, last in zip([0, *at], at):  # the clock: the segment's steps and (lazy) update, the end's flush
            dist.barrier()
            t0 = time.perf_counter()
            stats = train_steps(forward, sync, data[0], data[1], batches[:last], epoch=epoch, first_step=first)
            if epoch == cfg["epochs"] and last == len(batches):
                sync.flush()
            run.seconds += max_over_ranks(time.perf_counter() - t0)
            run.loss_sum, run.loss_steps = stats.loss_sum, stats.steps
            run.evaluate((epoch - 1) * steps_per_epoch + last)
    counts = [[a, b] for a, b in zip(counts, (nic_tx_bytes(ifname), bytes_sent(sync)))]
    everyone = all_gather_json([digest(model), [None if None in c else c[1] - c[0] for c in counts]])
    if rank == 0:
        run.cache.save()
    out = {"world_size": n, "steps_per_epoch": steps_per_epoch, "steps": cfg["epochs"] * steps_per_epoch}
    out |= {"batch_size": recipe.batch_size, "compute_step_s": compute_s, "points": run.points}
    out |= {"train_seconds": run.seconds, "wall_seconds": time.time() - run.wall_start}
    out |= {"params_identical": len({d for d, _ in everyone}) == 1}
    out |= {"wire_bytes": [c[0] for _, c in everyone], "sent_bytes": [c[1] for _, c in everyone]}
    sync.close()
    end_worker(cfg, rank, out)
    return 0


def max_over_ranks(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    slowest = torch.tensor([seconds])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest[0])


def time_compute(cfg: dict, recipe, data, steps_per_epoch: int) -> float:
    """Compute only: this rank's seconds per step of a scratch copy of the model, every rank at once,
    no communication (after a few steps' warm-up)."""
    import torch
    import torch.distributed as dist

    from utils.learn.training import batches_of_epoch, make_optimizer

    torch.manual_seed(cfg["seed"])
    scratch = Net()
    local = LocalStep(*make_optimizer(scratch, recipe, steps_per_epoch))
    batches = batches_of_epoch(len(data[1]), 1, recipe)
    warm, steps = min(5, cfg["compute_steps"]), cfg["compute_steps"]
    cycle = [batches[s % len(batches)] for s in range(warm + steps)]
    train_steps(scratch, local, data[0], data[1], cycle[:warm])
    dist.barrier()
    t0 = time.perf_counter()
    train_steps(scratch, local, data[0], data[1], cycle[warm:])
    return (time.perf_counter() - t0) / steps


def make_run_sync(cfg: dict, model, recipe, steps_per_epoch: int):
    """(what the steps call forward, the gradient sync) of the configuration: ours, DDP or local SGD."""
    from utils.learn.training import make_optimizer
    from utils.sync.factory import make_gradient_sync

    spec = cfg["spec"]
    optimizer, scheduler = make_optimizer(model, recipe, steps_per_epoch)
    if spec["kind"] == "ours":
        settings = pick(cfg, "powersgd_rank powersgd_warmup outer outer_lr outer_momentum") | pick(spec, "sync_every")
        settings |= {"compress": spec["compress"], "timeout": cfg["op_timeout"], "merge_after": spec.get("merge_after")}
        return model, make_gradient_sync(model, our_sync(**cfg["ours"], **settings), optimizer, scheduler, cfg["seed"])
    if spec["kind"] == "localsgd":
        forward, wrapped = make_localsgd(model, optimizer, spec["sync_every"], cfg["localsgd_warmup"])
        return forward, LocalStep(wrapped, scheduler, at_end=lambda: average_parameters(model))
    hook = None if spec["compress"] == "none" else spec["compress"]
    forward, _ = make_ddp(model, hook, cfg["powersgd_rank"], cfg["powersgd_warmup"], cfg["seed"])
    return forward, LocalStep(optimizer, scheduler)


class Run:
    """The evaluation points of one training run: the clock (training seconds so far, max over ranks),
    the train loss since the last point, and rank 0's test accuracy (say: rank 0's print, else None)."""

    def __init__(self, model, test, steps_per_epoch, cache_path, say, prefix):
        self.model, self.test, self.steps_per_epoch, self.say, self.prefix = model, test, steps_per_epoch, say, prefix
        self.cache, self.points, self.seconds, self.wall_start = eval_cache(cache_path), [], 0.0, time.time()
        self.loss_sum, self.loss_steps = 0.0, 0

    def evaluate(self, step: int):
        """Clock stopped: rank 0 evaluates (or finds these very bits evaluated before), the others
        wait at the barrier."""
        import torch
        import torch.distributed as dist

        from utils.run import test_model

        if self.say is not None:
            key = f"{digest(self.model)}/{len(self.test[1])}"
            if key not in self.cache:
                torch.set_num_threads(os.cpu_count() or 1)  # the other ranks only wait meanwhile
                self.cache[key] = test_model(self.model, *self.test)
                torch.set_num_threads(1)
            accuracy, epoch = self.cache[key], step / self.steps_per_epoch
            loss = self.loss_sum / self.loss_steps if self.loss_steps else None
            point = {"epoch": round(epoch, 4), "step": step, "seconds": self.seconds, "accuracy": accuracy}
            self.points.append(point | {"train_loss": loss})
            self.say(
                f"{self.prefix} step {step} (epoch {epoch:.2f}): test accuracy {accuracy:.2%}, "
                f"{self.seconds:.1f} s of training"
            )
        self.loss_sum, self.loss_steps = 0.0, 0
        dist.barrier()
