"""Compressed gradient sums (utils/comm/compress.py): right within the wire format, identical on every rank.

Real processes and gloo over loopback; tests/compress_worker.py is one rank.
"""

import os

import pytest
import torch
from compress_worker import SHAPES, SIZES, inputs, low_rank
from procs import run_workers

WORKER = os.path.join(os.path.dirname(__file__), "compress_worker.py")


def assert_same_on_every_rank(results, part):
    for key, value in results[0][part].items():
        for r in range(1, len(results)):
            assert torch.equal(results[r][part][key], value), f"{part}/{key}: rank {r} differs from rank 0"


@pytest.fixture(scope="module", params=[1, 2, 3, 4, 5])
def ranks(request, tmp_path_factory):
    world_size = request.param
    return world_size, run_workers(WORKER, world_size, tmp_path_factory.mktemp(f"compress{world_size}"))


@pytest.mark.timeout(240)
def test_16_bit_sums_are_right_to_one_rounding_per_hop(ranks):
    n, results = ranks
    assert_same_on_every_rank(results, "half")
    checked = 0
    for key, got in results[0]["half"].items():
        if key.startswith("fp16-jump"):
            continue
        name, algorithm, size, scale = key.split("/")
        xs = [inputs(r, int(size), float(scale)).double() for r in range(n)]
        reference, magnitude = sum(xs) / n, sum(x.abs() for x in xs)
        unit = 2.0 ** (-8 if name == "bf16" else -11)  # the wire format's rounding, relative
        # Float32 adds, one rounding per hop: at most about one unit per rank's share, whatever N.
        bound = 2 * unit * magnitude / n * max(1, n - 1) + magnitude.max() * 2.0**-24
        assert torch.all((got.double() - reference).abs() <= bound), key
        checked += 1
    assert checked == 2 * 3 * len(SIZES) + 2 * 3 * len(SIZES)  # bf16: 1 scale, fp16: 3 scales


@pytest.mark.timeout(240)
def test_fp16_keeps_tiny_and_huge_gradients_and_survives_a_jump(ranks):
    n, results = ranks
    half = results[0]["half"]
    for algorithm in ("two-pass", "ring", "gloo"):
        for scale in ("1e-07", "1e+06"):  # subnormal in float16 / beyond its 65504, unscaled
            got = half[f"fp16/{algorithm}/9973/{scale}"].double()
            reference = sum(inputs(r, 9973, float(scale)).double() for r in range(n)) / n
            relative = ((got - reference).norm() / reference.norm()).item()
            assert relative < 2e-3, (algorithm, scale, relative)
    for step, scale in enumerate((1.0, 1e4)):  # the second step's gradient is 10,000x the first's
        got = half[f"fp16-jump/{step}"].double()
        reference = sum(inputs(r, 9973, scale, step).double() for r in range(n)) / n
        assert torch.isfinite(got).all()
        assert ((got - reference).norm() / reference.norm()).item() < 2e-3


@pytest.mark.timeout(240)
def test_powersgd_recovers_a_sum_of_rank_at_most_r_exactly(ranks):
    n, results = ranks
    assert_same_on_every_rank(results, "lowrank")
    mean_matrix = sum(low_rank(r, 40, 30, 2) for r in range(n)).double() / n
    mean_bias = sum(inputs(r, 30) for r in range(n)).double() / n
    for algorithm, got in results[0]["lowrank"].items():
        matrix, bias = got[:1200].view(40, 30).double(), got[1200:].double()
        assert torch.allclose(matrix, mean_matrix, rtol=0, atol=1e-4 * mean_matrix.abs().max().item()), algorithm
        assert torch.allclose(bias, mean_bias, rtol=0, atol=1e-6 * n), algorithm


@pytest.mark.timeout(240)
def test_powersgd_error_feedback_keeps_the_books(ranks):
    """N x (every update applied) + every rank's remaining error = the sum of all gradients."""
    n, results = ranks
    updates = results[0]["books"]["updates"]
    for r in range(1, n):
        assert torch.equal(results[r]["books"]["updates"], updates)
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    steps = len(updates)
    gradients = sum(inputs(r, numel, 1.0, t).double() for r in range(n) for t in range(steps))
    errors = sum(results[r]["books"]["error"].double() for r in range(n))
    assert torch.allclose(n * updates.double().sum(0) + errors, gradients, rtol=0, atol=1e-4 * n * steps)
    # warm-up: the first two steps are the plain mean, with nothing left over
    for t in range(2):
        plain = sum(inputs(r, numel, 1.0, t).double() for r in range(n)) / n
        assert torch.allclose(updates[t].double(), plain, rtol=0, atol=1e-6 * n)
    if n > 1:  # compressed steps leave something out, and send far fewer bytes than plain ones
        assert errors.abs().max() > 1e-3
        plain_bytes = 2 * (n - 1) / n * numel * 4
        assert results[0]["books"]["bytes_sent"].item() < 2.5 * plain_bytes + (steps - 2) * 0.3 * plain_bytes
