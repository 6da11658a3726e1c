"""Worlds of 1-5 ranks, real processes and gloo over loopback (tests/support/ring_worker.py is one rank, which
does all of this in one process):
- the ring sums (utils/comm/ring.py): correct against a float64 reference, bit-identical on every rank;
- compressed sums (utils/comm/compress.py): right within the wire format, identical on every rank;
- --sync-every 3 (utils/sync/periodic.py) under every algorithm: the float64 replay of tests/support/periodic_world.py
  (3 ranks of it are also tests/world/test_tiny_world.py's quick world).
"""

import os

import pytest
import torch
from compress_worker import SHAPES, SIZES, low_rank
from compress_worker import inputs as compress_inputs
from periodic_world import check_periodic
from procs import run_workers
from ring_worker import cases, inputs

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "ring_worker.py")


@pytest.fixture(scope="module", params=[1, 2, 3, 4, 5])
def ranks(request, tmp_path_factory):
    """One world of `request.param` ranks, 2 to a fake host (for the hierarchical sum): what each rank saved."""
    n = request.param
    env = lambda r: dict(os.environ, OMP_NUM_THREADS="1")  # noqa: E731
    return n, run_workers(WORKER, n, tmp_path_factory.mktemp(f"world{n}"), env=env, timeout=300)


@pytest.mark.timeout(400)
def test_every_algorithm_sums_exactly_once_and_identically(ranks):
    world_size, results = ranks
    checked = 0
    for size, algorithm, chunks in cases(world_size):
        key = f"{size}/{algorithm}/{chunks}"
        if world_size == 2 and algorithm.startswith("two-pass-"):  # started at rank 1: g1 + g0 is g0 + g1
            assert torch.equal(results[0]["sums"][key], results[0]["sums"][f"{size}/two-pass/{chunks}"]), key
        reference = sum(inputs(r, size).double() for r in range(world_size))
        got = results[0]["sums"][key]
        assert got.shape == (size,)
        # float32 sums of N values: error bounded by about N ulp of the largest magnitude
        assert torch.allclose(got.double(), reference, rtol=0, atol=1e-5 * world_size * 8), key
        for r in range(1, world_size):
            assert torch.equal(results[r]["sums"][key], got), f"{key}: rank {r} differs from rank 0"
        checked += 1
    assert checked == len(list(cases(world_size)))
    # the weighed chain starts at the rank with fewer images when there are two ranks, and at rank 0 otherwise
    weighed = [results[r]["sums"]["starts"] for r in range(world_size)]
    assert weighed == [[1 if world_size == 2 else 0] * len(weighed[0])] * world_size and weighed[0]


@pytest.mark.timeout(400)
def test_sync_every_h_every_algorithm_both_outer_steps(ranks):
    check_periodic(ranks[1])


def assert_same_on_every_rank(results, part):
    for key, value in results[0][part].items():
        for r in range(1, len(results)):
            assert torch.equal(results[r][part][key], value), f"{part}/{key}: rank {r} differs from rank 0"


@pytest.mark.timeout(400)
def test_16_bit_sums_are_right_to_one_rounding_per_hop(ranks):
    n, results = ranks
    assert_same_on_every_rank(results, "half")
    checked = 0
    for key, got in results[0]["half"].items():
        if key.startswith("fp16-jump"):
            continue
        name, algorithm, size, scale = key.split("/")
        xs = [compress_inputs(r, int(size), float(scale)).double() for r in range(n)]
        reference, magnitude = sum(xs) / n, sum(x.abs() for x in xs)
        unit = 2.0 ** (-8 if name == "bf16" else -11)  # the wire format's rounding, relative
        # Float32 adds, one rounding per hop: at most about one unit per rank's share, whatever N.
        bound = 2 * unit * magnitude / n * max(1, n - 1) + magnitude.max() * 2.0**-24
        assert torch.all((got.double() - reference).abs() <= bound), key
        checked += 1
    assert checked == 2 * 3 * len(SIZES) + 2 * 3 * len(SIZES)  # bf16: 1 scale, fp16: 3 scales


@pytest.mark.timeout(400)
def test_fp16_keeps_tiny_and_huge_gradients_and_survives_a_jump(ranks):
    n, results = ranks
    half = results[0]["half"]
    for algorithm in ("two-pass", "ring", "gloo"):
        for scale in ("1e-07", "1e+06"):  # subnormal in float16 / beyond its 65504, unscaled
            got = half[f"fp16/{algorithm}/9973/{scale}"].double()
            reference = sum(compress_inputs(r, 9973, float(scale)).double() for r in range(n)) / n
            relative = ((got - reference).norm() / reference.norm()).item()
            assert relative < 2e-3, (algorithm, scale, relative)
    for step, scale in enumerate((1.0, 1e4)):  # the second step's gradient is 10,000x the first's
        got = half[f"fp16-jump/{step}"].double()
        reference = sum(compress_inputs(r, 9973, scale, step).double() for r in range(n)) / n
        assert torch.isfinite(got).all()
        assert ((got - reference).norm() / reference.norm()).item() < 2e-3


@pytest.mark.timeout(400)
def test_powersgd_recovers_a_sum_of_rank_at_most_r_exactly(ranks):
    n, results = ranks
    assert_same_on_every_rank(results, "lowrank")
    mean_matrix = sum(low_rank(r, 40, 30, 2) for r in range(n)).double() / n
    mean_bias = sum(compress_inputs(r, 30) for r in range(n)).double() / n
    for algorithm, got in results[0]["lowrank"].items():
        matrix, bias = got[:1200].view(40, 30).double(), got[1200:].double()
        assert torch.allclose(matrix, mean_matrix, rtol=0, atol=1e-4 * mean_matrix.abs().max().item()), algorithm
        assert torch.allclose(bias, mean_bias, rtol=0, atol=1e-6 * n), algorithm


@pytest.mark.timeout(400)
def test_powersgd_error_feedback_keeps_the_books(ranks):
    """N x (every update applied) + every rank's remaining error = the sum of all gradients."""
    n, results = ranks
    updates = results[0]["books"]["updates"]
    for r in range(1, n):
        assert torch.equal(results[r]["books"]["updates"], updates)
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    steps = len(updates)
    gradients = sum(compress_inputs(r, numel, 1.0, t).double() for r in range(n) for t in range(steps))
    errors = sum(results[r]["books"]["error"].double() for r in range(n))
    assert torch.allclose(n * updates.double().sum(0) + errors, gradients, rtol=0, atol=1e-4 * n * steps)
    # warm-up: the first two steps are the plain mean, with nothing left over
    for t in range(2):
        plain = sum(compress_inputs(r, numel, 1.0, t).double() for r in range(n)) / n
        assert torch.allclose(updates[t].double(), plain, rtol=0, atol=1e-6 * n)
    if n > 1:  # compressed steps leave something out, and send far fewer bytes than plain ones
        assert errors.abs().max() > 1e-3
        plain_bytes = 2 * (n - 1) / n * numel * 4
        assert results[0]["books"]["bytes_sent"].item() < 2.5 * plain_bytes + (steps - 2) * 0.3 * plain_bytes
