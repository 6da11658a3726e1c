"""One rank of tests/world/test_ring.py's worlds: sums known inputs with every algorithm (cases()), through
the compressors (tests/support/compress_worker.py) and under --sync-every (tests/support/periodic_world.py);
saves what it got.
One process per rank does all three, so each world size starts once."""

import datetime
import sys

import torch
import torch.distributed as dist
from compress_worker import half_precision, powersgd_books, powersgd_low_rank
from periodic_world import periodic

from utils.comm import hierarchical, ring
from utils.comm.allreduce import make_allreduce


def inputs(rank, size):
    return torch.randn(size, generator=torch.Generator().manual_seed(1000 * rank + size))


def cases(world_size):
    sizes = sorted({1, 7, 1000, 1_000_003, max(1, world_size - 1), world_size + 1, 13, 9973})
    yield from ((size, "two-pass", 1) for size in sizes)
    yield from ((size, "two-pass", 4) for size in sizes)
    yield from ((size, "two-pass", "auto") for size in sizes)
    yield from ((size, "ring", 1) for size in sizes)
    yield from ((size, "gloo", 1) for size in sizes)
    yield from ((size, "two-pass-from-last", chunks) for size in sizes for chunks in (1, 4))
    yield from ((size, "two-pass-weighed", 1) for size in sizes)


def sums(rank, world_size):
    results, starts = {}, []
    for size, algorithm, chunks in cases(world_size):
        flat = inputs(rank, size)
        if algorithm == "two-pass-from-last":  # the chain started at rank N-1
            ring.two_pass_ring_sum(flat, chunks, first=world_size - 1)
        elif algorithm == "two-pass-weighed":  # rank N-1 has the fewest images, rank 0 the most
            allreduce = make_allreduce("two-pass", chunks)
            allreduce.weigh(0.5 if rank == world_size - 1 else 1.5 if rank == 0 else 1.0)
            starts.append(allreduce.first)
            allreduce.sum_(flat)
        else:
            make_allreduce(algorithm, chunks).sum_(flat)
        results[f"{size}/{algorithm}/{chunks}"] = flat
    return results | {"starts": starts}


if __name__ == "__main__":
    rank, world_size, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    results = {
        "sums": sums(rank, world_size),
        "half": half_precision(rank, world_size),
        "lowrank": powersgd_low_rank(rank, world_size),
        "books": powersgd_books(rank, world_size),
        **periodic(rank, hosts=hierarchical.discover("abc"[rank // 2])),  # 2 ranks to a fake host
    }
    torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()
