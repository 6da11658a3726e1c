"""One rank of tests/world/test_tiny_world.py's tiny gloo world: every all-reduce object, and the gradient-sync seam."""

import datetime
import sys

import torch
import torch.distributed as dist
from periodic_world import periodic

from utils.comm import hierarchical
from utils.comm.allreduce import ALGORITHMS, make_allreduce
from utils.learn.model import Net, parameter_vector
from utils.learn.training import make_optimizer
from utils.run import train_step
from utils.setup.config import Recipe, Sync
from utils.sync.factory import make_gradient_sync
from utils.sync.interface import DistributedOptimizer


def inputs(rank, size):
    return torch.randn(size, generator=torch.Generator().manual_seed(10 * rank + size))


def sums(rank, hosts):
    results = {}
    for name in ALGORITHMS:
        allreduce = make_allreduce(name, chunks=3, own_group=True, hosts=hosts)
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
        optimizer_view = DistributedOptimizer(gradient_sync)
        for step in range(3):
            images = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(100 * step + rank))
            train_step(model, images, torch.arange(4) + rank, gradient_sync, optimizer_view)
        gradient_sync.finish()
        results[mode] = parameter_vector(model).clone()
        results[f"{mode}/bytes"] = torch.tensor(gradient_sync.stats()["bytes_sent"])
        gradient_sync.close()
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
    hosts = hierarchical.discover("abc"[rank // 2])  # 2 ranks to a fake host, for the hierarchical sum
    torch.save({**sums(rank, hosts), **training(rank, world_size), **periodic(rank, hosts=hosts)}, out)
    dist.barrier()
    dist.destroy_process_group()
