"""A tiny gloo world of 3 ranks on loopback (2 fake hosts: 2 + 1 ranks): every all-reduce object sums
right and alike on every rank, and the gradient-sync seam's ways of summing agree."""

import os
import subprocess
import sys

import pytest
import torch

from utils.launch import free_port, supervise

HERE = os.path.dirname(os.path.abspath(__file__))
ALGORITHMS = ("two-pass", "ring", "gloo", "hierarchical")


def run_world(folder, n, *mode):
    """n ranks of world_worker.py on loopback, 2 ranks to a fake host: what each rank saved."""
    port = free_port()
    outs = [folder / f"rank{r}.pt" for r in range(n)]
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "world_worker.py"), str(r), str(n), str(port), str(outs[r]), *mode],
            env=dict(os.environ, OMP_NUM_THREADS="1", RING_HOST_ID="abc"[r // 2]),
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


def outer_step(anchor, momentum, mean_change, outer):
    """The outer step in float64, by the formulas: averaging, or DiLoCo's SGD with Nesterov momentum
    (lr 0.7, momentum 0.9)."""
    if outer == "average":
        return anchor - mean_change, momentum
    momentum = 0.9 * momentum + mean_change
    return anchor - 0.7 * (mean_change + 0.9 * momentum), momentum


def check_periodic(results, every=3):
    """Every round's mean change reaches the anchor once, at the merge step of the next round (a
    float64 replay of what the ranks recorded); the anchor is bit-identical on every rank at every
    step; a merge swaps a rank's own change for the mean and keeps its steps since; no other step
    moves the parameters but the optimizer; flush() leaves one model on all ranks."""
    keys = sorted({k.rsplit("/", 1)[0] for k in results[0] if k.startswith("periodic/")})
    assert len(keys) == 10, keys
    for key in keys:
        outer, merge_after = key.split("/")[2], int(key.split("/")[4])
        tolerance = 1e-3 if "/fp16/" in key else 1e-6
        for what in ("anchor", "final", "initial"):
            assert all(torch.equal(r[f"{key}/{what}"], results[0][f"{key}/{what}"]) for r in results), (key, what)
        # each round's change on each rank: its start point minus where its optimizer left it at the round's end
        ends = [t for t in range(len(results[0][f"{key}/after"])) if (t + 1) % every == 0]
        means = torch.stack(
            [torch.stack([(r[f"{key}/start"][t] - r[f"{key}/after"][t]).double() for t in ends]) for r in results]
        ).mean(0)
        assert means.abs().max() > 1e-3, key  # the rounds moved the parameters: the checks below bite
        anchor, momentum, merged = results[0][f"{key}/initial"].double(), 0.0, 0
        for t in range(len(results[0][f"{key}/after"])):
            inner, round_ = t % every + 1, t // every
            if inner == merge_after and round_ > 0:
                anchor, momentum = outer_step(anchor, momentum, means[round_ - 1], outer)
                merged += 1
            assert torch.allclose(results[0][f"{key}/anchor"][t].double(), anchor, atol=tolerance, rtol=0), (key, t)
            for r in results:
                after, start = r[f"{key}/after"][t], r[f"{key}/start"][t]
                expected = r[f"{key}/anchor"][t] - (start - after) if inner == merge_after and round_ > 0 else after
                assert torch.equal(r[f"{key}/params"][t], expected), (key, t)
        if merged < len(ends):  # flush(): the last full round's mean if not merged yet, then the cut-short round's
            anchor, momentum = outer_step(anchor, momentum, means[-1], outer)
        cut_short = torch.stack([r[f"{key}/cut-short"].double() for r in results]).mean(0)
        anchor, momentum = outer_step(anchor, momentum, cut_short, outer)
        assert torch.allclose(results[0][f"{key}/final"].double(), anchor, atol=tolerance, rtol=0), key


@pytest.mark.timeout(120)
def test_sync_every_h_on_3_ranks_every_algorithm_both_outer_steps(results):
    check_periodic(results)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4, 5])
def test_sync_every_h_on_2_4_and_5_ranks(tmp_path, n):
    check_periodic(run_world(tmp_path, n, "periodic"))
