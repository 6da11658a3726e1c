"""The ring sums: correct against a float64 reference and bit-identical on every rank."""

import os

import pytest
import torch
from procs import run_workers
from ring_worker import cases, inputs

WORKER = os.path.join(os.path.dirname(__file__), "ring_worker.py")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_every_algorithm_sums_exactly_once_and_identically(world_size, tmp_path):
    results = run_workers(WORKER, world_size, tmp_path)
    checked = 0
    for size, algorithm, chunks in cases(world_size):
        key = f"{size}/{algorithm}/{chunks}"
        reference = sum(inputs(r, size).double() for r in range(world_size))
        got = results[0][key]
        assert got.shape == (size,)
        # float32 sums of N values: error bounded by about N ulp of the largest magnitude
        assert torch.allclose(got.double(), reference, rtol=0, atol=1e-5 * world_size * 8), key
        for r in range(1, world_size):
            assert torch.equal(results[r][key], got), f"{key}: rank {r} differs from rank 0"
        checked += 1
    assert checked == len(list(cases(world_size)))
