"""A tiny gloo world of 3 ranks on loopback (2 fake hosts: 2 + 1 ranks): every all-reduce object sums
right and alike on every rank, the gradient-sync seam's ways of summing agree, and --sync-every 3 replays
right (tests/support/periodic_world.py; on 1-5 ranks in tests/world/test_ring.py, whose worlds start anyway)."""

import os
import subprocess
import sys

import pytest
import torch
from periodic_world import check_periodic

from utils.setup.launch import free_port, supervise

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
ALGORITHMS = ("two-pass", "ring", "gloo", "hierarchical")


def run_world(folder, n):
    """n ranks of world_worker.py on loopback, 2 ranks to a fake host: what each rank saved."""
    port = free_port()
    outs = [folder / f"rank{r}.pt" for r in range(n)]
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "world_worker.py"), str(r), str(n), str(port), str(outs[r])],
            env=dict(os.environ, OMP_NUM_THREADS="1"),  # (the worker fakes its host: 2 ranks to one)
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(n)
    ]
    outcome = supervise(procs, timeout=90)
    assert outcome.codes == [0] * n and not outcome.timed_out, [err for _, err in outcome.outputs]
    return [torch.load(o, weights_only=True) for o in outs]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world(tmp_path_factory.mktemp("world"), 3)


def exact(size):
    return sum(torch.randn(size, generator=torch.Generator().manual_seed(10 * r + size)).double() for r in range(3))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_algorithm_sums_right_and_alike(results, name):
    for wire, tolerance in (("None", 1e-6), ("torch.bfloat16", 2e-2)):
        for size in (1, 5, 1001):
            key = f"{name}/{wire}/{size}"
            assert all(torch.equal(r[key], results[0][key]) for r in results), key
            assert torch.allclose(results[0][key].double(), exact(size), rtol=tolerance, atol=tolerance), key
    assert all(torch.equal(r[f"{name}/async"], results[0][f"{name}/async"]) for r in results)
    assert torch.allclose(results[0][f"{name}/async"].double(), exact(77), atol=1e-5)
    assert all(r[f"{name}/bytes"][0] > 0 for r in results)  # every rank sent something, and counted it


@pytest.mark.timeout(120)
def test_the_ways_of_summing_train_the_same_model(results):
    for mode in ("plain", "overlap", "lazy", "lazy-powersgd"):
        assert all(torch.equal(r[mode], results[0][mode]) for r in results), mode  # identical on every rank
    assert torch.equal(results[0]["plain"], results[0]["overlap"])  # two-pass: one order of adds, any buckets
    assert torch.equal(results[0]["overlap"], results[0]["lazy"])  # lazy only moves the update
    assert not torch.equal(results[0]["lazy"], results[0]["lazy-powersgd"])
    assert results[0]["lazy-powersgd/bytes"] < results[0]["lazy/bytes"]


@pytest.mark.timeout(120)
def test_sync_every_h_on_3_ranks_every_algorithm_both_outer_steps(results):
    check_periodic(results)
