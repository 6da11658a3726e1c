"""What one rank of the compression tests does (tests/support/ring_worker.py runs it): averages known gradients through
utils/comm/compress.py."""

import torch

from utils.comm.allreduce import make_allreduce
from utils.comm.compress import make_compressor

SIZES = (1, 7, 9973, 100_003)
SHAPES = [(32, 1, 3, 3), (32,), (64, 288), (10, 129), (5,)]  # conv, bias, matrices, a vector


def inputs(rank, size, scale=1.0, step=0):
    return scale * torch.randn(size, generator=torch.Generator().manual_seed(100_000 * step + 1000 * rank + size))


def low_rank(rank, rows, cols, r):
    """This rank's matrix: A·C_rank·Bᵀ, so the sum over ranks has rank <= r."""
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(rows, r, generator=g), torch.randn(cols, r, generator=g)
    c = torch.randn(r, r, generator=torch.Generator().manual_seed(100 + rank))
    return a @ c @ b.t()


def half_precision(rank, n):
    """bf16 and fp16 through every algorithm, sizes awkward for N; fp16 also tiny and huge values."""
    results = {}
    for name in ("bf16", "fp16"):
        for algorithm, chunks in (("two-pass", 3), ("ring", 1), ("gloo", 1)):
            for size in SIZES:
                for scale in (1.0, 1e-7, 1e6) if name == "fp16" else (1.0,):
                    compressor = make_compressor(name, [[torch.empty(size)]])
                    flat = inputs(rank, size, scale)
                    compressor.average_(flat, 0, make_allreduce(algorithm, chunks))
                    results[f"{name}/{algorithm}/{size}/{scale:g}"] = flat
    # fp16's scale comes from the last sum: a gradient 1e4 times larger must not overflow
    compressor, sum_ = make_compressor("fp16", [[torch.empty(9973)]]), make_allreduce("ring", 1)
    for step, scale in enumerate((1.0, 1e4)):
        flat = inputs(rank, 9973, scale, step)
        compressor.average_(flat, 0, sum_)
        results[f"fp16-jump/{step}"] = flat
    return results


def powersgd_low_rank(rank, n):
    """A sum of rank <= R comes back exactly (R = 2), through every algorithm."""
    results = {}
    for algorithm in ("two-pass", "ring", "gloo"):
        params = [torch.empty(40, 30), torch.empty(30)]
        compressor = make_compressor("powersgd", [params], powersgd_rank=2, powersgd_warmup=0, seed=3)
        flat = torch.cat([low_rank(rank, 40, 30, 2).reshape(-1), inputs(rank, 30)])
        compressor.average_(flat, 0, make_allreduce(algorithm, "auto"))
        results[algorithm] = flat
    return results


def powersgd_books(rank, n, steps=6):
    """Several steps of PowerSGD with warm-up 2: every step's average, and this rank's final error."""
    params = [torch.empty(s) for s in SHAPES]
    numel = sum(p.numel() for p in params)
    compressor = make_compressor("powersgd", [params], powersgd_rank=2, powersgd_warmup=2, seed=1)
    sum_, updates = make_allreduce("ring", 1), []
    for step in range(steps):
        flat = inputs(rank, numel, 1.0, step)
        updates.append(compressor.average_(flat, 0, sum_).clone())
    return {
        "updates": torch.stack(updates),
        "error": compressor.state_dict()["errors"][0],
        "bytes_sent": torch.tensor(sum_.bytes_sent),
    }
