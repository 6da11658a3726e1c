"""One rank of the fast tier's tiny gloo world: every all-reduce object, and the gradient-sync seam."""

import datetime
import sys

import torch
import torch.distributed as dist

from utils.comm.allreduce import ALGORITHMS, make_allreduce
from utils.comm.compress import make_compressor
from utils.config import Recipe, Sync
from utils.model import Net
from utils.run import make_optimizer, train_step
from utils.sync.factory import make_gradient_sync
from utils.sync.periodic import PeriodicSync


def inputs(rank, size):
    return torch.randn(size, generator=torch.Generator().manual_seed(10 * rank + size))


def sums(rank):
    results = {}
    for name in ALGORITHMS:
        allreduce = make_allreduce(name, chunks=3, own_group=True)
        for wire in (None, torch.bfloat16):
            for size in (1, 5, 1001):
                flat = inputs(rank, size)
                allreduce.sum_(flat, wire)
                results[f"{name}/{wire}/{size}"] = flat
        buffer = inputs(rank, 77)
        work = allreduce.sum_async(buffer)
        work.wait()
        results[f"{name}/async"] = buffer
        results[f"{name}/bytes"] = torch.tensor([allreduce.bytes_sent, allreduce.bytes_summed])
    return results


def training(rank, world_size):
    """Three steps of the CNN under each way of summing: the parameters after them."""
    results = {}
    for mode, sync in {
        "plain": Sync(overlap=False),
        "overlap": Sync(),
        "lazy": Sync(lazy_update=True),
        "lazy-powersgd": Sync(lazy_update=True, compress="powersgd", powersgd_rank=2, powersgd_warmup=1),
    }.items():
        torch.manual_seed(1)
        model = Net()
        optimizer, scheduler = make_optimizer(model, Recipe(epochs=1), 3)
        gradient_sync = make_gradient_sync(model, sync, optimizer, scheduler, seed=1)
        for step in range(3):
            images = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(100 * step + rank))
            train_step(model, gradient_sync, images, torch.arange(4) + rank)
        gradient_sync.finish()
        results[mode] = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
        results[f"{mode}/bytes"] = torch.tensor(gradient_sync.stats()["bytes_sent"])
        gradient_sync.close()
    return results


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the parameters after its last step: the inner steps' end point, before the
    round's end moves them."""

    def step(self, closure=None):
        loss = super().step(closure)
        self.after = torch.cat([p.detach().reshape(-1) for g in self.param_groups for p in g["params"]])
        return loss


def periodic(rank, rounds=4, every=3):
    """--sync-every 3 on a tiny linear model, under every all-reduce and both outer steps, merging one
    step into the next round (and a round's end merge, and fp16, on the ring): at every step this
    rank's start point before it, its parameters after the optimizer and after the step, and the
    anchor; then 2 steps of a round cut short, and flush(). The test replays it in float64."""
    results = {}
    plan = [(name, outer, "none", 1) for name in ALGORITHMS for outer in ("average", "nesterov")]
    for name, outer, wire, merge_after in plan + [("ring", "average", "none", 3), ("ring", "nesterov", "fp16", 2)]:
        torch.manual_seed(1)
        model = torch.nn.Linear(5, 3)
        optimizer = RecordingSGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        sync = PeriodicSync(
            model,
            make_allreduce(name, chunks=3, own_group=True),
            make_compressor(wire, [list(model.parameters())]),
            optimizer,
            scheduler,
            every,
            outer,
            merge_after=merge_after,
        )
        key = f"periodic/{name}/{outer}/{wire}/{merge_after}"
        results[f"{key}/initial"] = sync.anchor.clone()
        record = {"start": [], "after": [], "params": [], "anchor": []}
        for step in range(1, rounds * every + 3):
            images = torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank))
            model(images).square().mean().backward()
            record["start"].append(sync.start.clone())
            sync.after_backward()
            sync.step()
            record["after"].append(optimizer.after)
            record["params"].append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
            record["anchor"].append(sync.anchor.clone())
        results[f"{key}/cut-short"] = sync.start - record["params"][-1]  # the last round's steps so far
        sync.flush()
        results.update({f"{key}/{what}": torch.stack(values) for what, values in record.items()})
        results[f"{key}/final"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        sync.close()
    return results


if __name__ == "__main__":
    rank, world_size, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=30),
    )
    only_periodic = sys.argv[5:] == ["periodic"]
    torch.save(periodic(rank) if only_periodic else {**sums(rank), **training(rank, world_size), **periodic(rank)}, out)
    dist.barrier()
    dist.destroy_process_group()
