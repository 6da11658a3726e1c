"""bench/time_to_accuracy.py's ranks: one configuration trained from scratch, the clock paused at
every evaluation.

Ours, DDP and local SGD run the trainer's own step, utils.run.train_step, with the trainer's recipe
(utils.config.Recipe, make_optimizer, batches_of_epoch): ours with utils.sync.buckets's sync of the
--ours configuration (ours@H: utils/sync/periodic.py), DDP, torch's local SGD (peers.make_localsgd) and
the compute-only timing with peers.LocalStep.

The last evaluation point is the end of training: there the sync's flush() makes every rank's
parameters the same (ours@H: the rounds still in flight applied; local SGD: one more average), as
train.py's end does, on the clock. The other points only finish() the step: with @H, rank 0's
model is evaluated as it stands between syncs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from harness import REPO, digest, start_worker
from peers import LocalStep, average_parameters, bytes_sent, make_ddp, make_localsgd, nic_tx_bytes, our_sync

from utils.files import write_file


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
    cfg = json.loads(Path(args.config).read_text())
    rank, n, spec = args.rank, cfg["world_size"], cfg["spec"]

    import torch
    import torch.distributed as dist

    from utils.config import Recipe
    from utils.data import load_mnist
    from utils.model import Net
    from utils.run import batches_of_epoch, make_optimizer, test_model, train_step
    from utils.sync.buckets import make_gradient_sync

    say = start_worker(cfg, rank)
    prefix = f"  [{cfg['label']} N={n} {spec['name']}]"
    train_images, train_labels, test_images, test_labels = load_mnist(str(REPO / "data"))
    if cfg["train_subset"]:
        train_images, train_labels = train_images[: cfg["train_subset"]], train_labels[: cfg["train_subset"]]
    if cfg["test_subset"]:
        test_images, test_labels = test_images[: cfg["test_subset"]], test_labels[: cfg["test_subset"]]
    recipe = Recipe(
        batch_size=max(1, cfg["global_batch"] // n),
        global_batch=cfg["global_batch"],
        lr=cfg["lr"],
        seed=cfg["seed"],
        epochs=cfg["epochs"],
        train_subset=cfg["train_subset"],
        test_subset=cfg["test_subset"],
    )
    steps_per_epoch = len(batches_of_epoch(len(train_labels), 1, recipe))
    slowest = torch.zeros(1)

    def max_over_ranks(seconds: float) -> float:
        slowest[0] = seconds
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return float(slowest[0])

    # compute only: a scratch copy of the model, every rank at once, no communication
    torch.manual_seed(cfg["seed"])
    scratch = Net()
    local = LocalStep(*make_optimizer(scratch, recipe, steps_per_epoch))
    batches = batches_of_epoch(len(train_labels), 1, recipe)
    warm = min(5, cfg["compute_steps"])
    for s in range(warm + cfg["compute_steps"]):
        if s == warm:
            dist.barrier()
            t0 = time.perf_counter()
        batch, weight, _ = batches[s % len(batches)]
        train_step(scratch, local, train_images[batch], train_labels[batch], weight).item()
    compute_s = max_over_ranks((time.perf_counter() - t0) / cfg["compute_steps"])
    del scratch, local

    # the run
    torch.manual_seed(cfg["seed"])
    model = forward = Net()
    optimizer, scheduler = make_optimizer(model, recipe, steps_per_epoch)
    if spec["kind"] == "ours":
        sync = make_gradient_sync(
            model,
            our_sync(
                **cfg["ours"],
                compress=spec["compress"],
                powersgd_rank=cfg["powersgd_rank"],
                powersgd_warmup=cfg["powersgd_warmup"],
                timeout=cfg["op_timeout"],
                sync_every=spec["sync_every"],
                outer=cfg["outer"],
                outer_lr=cfg["outer_lr"],
                outer_momentum=cfg["outer_momentum"],
                merge_after=spec.get("merge_after"),
            ),
            optimizer,
            scheduler,
            cfg["seed"],
        )
    elif spec["kind"] == "localsgd":
        forward, wrapped = make_localsgd(model, optimizer, spec["sync_every"], cfg["localsgd_warmup"])
        sync = LocalStep(wrapped, scheduler, at_end=lambda: average_parameters(model))
    else:
        forward, _ = make_ddp(
            model,
            None if spec["compress"] == "none" else spec["compress"],
            cfg["powersgd_rank"],
            cfg["powersgd_warmup"],
            cfg["seed"],
        )
        sync = LocalStep(optimizer, scheduler)
    say(
        f"{prefix} {n} ranks up, batch {recipe.batch_size}/rank, {steps_per_epoch} steps/epoch, "
        f"compute only {compute_s * 1e3:.1f} ms/step (GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', '-')})"
    )

    nic = os.environ.get("GLOO_SOCKET_IFNAME")
    points, train_s, loss_sum, loss_steps = [], 0.0, 0.0, 0
    tx_start, sent_start = nic_tx_bytes(nic), bytes_sent(sync)
    wall_start = time.time()

    cache = eval_cache(cfg.get("eval_cache"))

    def evaluate(step: int):
        """Clock stopped: rank 0 evaluates (or finds these very bits evaluated before), the others
        wait at the barrier."""
        nonlocal loss_sum, loss_steps
        if rank == 0:
            key = f"{digest(model)}/{len(test_labels)}"
            if key not in cache:
                torch.set_num_threads(os.cpu_count() or 1)  # the other ranks only wait meanwhile
                with torch.no_grad():
                    cache[key] = test_model(model, test_images, test_labels)
                torch.set_num_threads(1)
            accuracy = cache[key]
            model.train()
            points.append(
                {
                    "epoch": round(step / steps_per_epoch, 4),
                    "step": step,
                    "seconds": train_s,
                    "accuracy": accuracy,
                    "train_loss": loss_sum / loss_steps if loss_steps else None,
                }
            )
            say(
                f"{prefix} step {step} (epoch {step / steps_per_epoch:.2f}): test accuracy {accuracy:.2%}, "
                f"{train_s:.1f} s of training"
            )
        loss_sum, loss_steps = 0.0, 0
        dist.barrier()

    model.train()
    evaluate(0)
    at = set(eval_steps(steps_per_epoch, cfg["evals_per_epoch"]))
    global_step = 0
    for epoch in range(1, cfg["epochs"] + 1):
        batches = batches_of_epoch(len(train_labels), epoch, recipe)
        dist.barrier()
        t0 = time.perf_counter()
        for step, (batch, weight, _) in enumerate(batches, 1):
            loss_sum += train_step(forward, sync, train_images[batch], train_labels[batch], weight).item()
            loss_steps += 1
            global_step += 1
            if step in at:  # the step's (lazy) update is training time, and so is the end's flush
                if epoch == cfg["epochs"] and step == len(batches):
                    sync.flush()
                else:
                    sync.finish()
                train_s += max_over_ranks(time.perf_counter() - t0)
                evaluate(global_step)
                dist.barrier()
                t0 = time.perf_counter()
    tx_end, sent_end = nic_tx_bytes(nic), bytes_sent(sync)
    digests = [None] * n
    dist.all_gather_object(digests, digest(model))
    tx = [None] * n
    dist.all_gather_object(
        tx,
        [
            None if tx_start is None or tx_end is None else tx_end - tx_start,
            None if sent_start is None or sent_end is None else sent_end - sent_start,
        ],
    )
    if rank == 0:
        cache.save()
        write_file(
            Path(cfg["out"]),
            json.dumps(
                {
                    "world_size": n,
                    "steps_per_epoch": steps_per_epoch,
                    "steps": global_step,
                    "batch_size": recipe.batch_size,
                    "compute_step_s": compute_s,
                    "points": points,
                    "train_seconds": train_s,
                    "wall_seconds": time.time() - wall_start,
                    "params_identical": len(set(digests)) == 1,
                    "wire_bytes": [t[0] for t in tx],
                    "sent_bytes": [t[1] for t in tx],
                }
            ).encode(),
        )
    sync.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0
