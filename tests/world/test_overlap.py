"""Every algorithm under every way of summing: overlapped and plain gradient sums train the same
model, and compressed sums (--compress powersgd, bf16, fp16) train and send what they should.

two-pass adds every element in the same order (g0 + g1 + ... + gN-1) however the buffer is cut
into buckets, so overlapped and plain runs must match bit for bit. ring and gloo cut their
buffer into segments whose boundaries move with the bucket sizes, so the order of additions -
and with it the float rounding - can differ: those are compared within a tolerance. Lazy
updates (--lazy-update) only move each bucket's Adam update into the next forward: the same
bits as overlapped, for every algorithm. The uncompressed runs are made once (a module fixture):
the 16-bit runs compare their bytes and accuracy with them, and the plain two-pass run records the
timeline that tests/world/test_timeline.py's check_trace reads for --no-overlap.
"""

import json
import subprocess
import sys

import procs
import pytest
import torch
from trace_checks import FIRST, LAST, SKEW_S, SUMMARY, check_trace

from utils.comm import ring
from utils.learn.model import Net
from utils.sync.buckets import make_buckets

SMALL = ["--test-subset", "1000", "--train-subset", "960", "--epochs", "1", "--bucket-mb", "0.05"]
MODES = {"plain": ["--no-overlap"], "overlapped": ["--overlap"], "lazy": ["--overlap", "--lazy-update"]}
TIMELINES = (("two-pass", "plain"), ("ring", "lazy"))


def train_3_ranks(tmp_path, name, args, env=None):
    ranks = procs.start_ranks(
        3,
        [
            *SMALL,
            *args,
            "--metrics",
            str(tmp_path / f"{name}.jsonl"),
            "--checkpoint",
            str(tmp_path / f"{name}.pt"),
            "--save-path",
            str(tmp_path / f"{name}.pth"),
        ],
        env=env,
    )
    results = procs.wait_all(ranks, timeout=150)
    assert [code for code, _, _ in results] == [0, 0, 0], [err for _, _, err in results]
    assert "parameters identical on all 3 ranks" in results[0][1]
    metrics = json.loads((tmp_path / f"{name}.jsonl").read_text().splitlines()[-1])
    return torch.load(tmp_path / f"{name}.pth", weights_only=True), metrics, results[0][1]


@pytest.fixture(scope="module")
def uncompressed(tmp_path_factory):
    """uncompressed(allreduce, mode): the model, metrics and stdout of that run, each made once. Two of
    them also record a timeline (which changes none of their numbers), for tests/world/test_timeline.py's check:
    the plain two-pass run, and the lazy ring run with rank 1's clock set SKEW_S seconds off."""
    folder, made = tmp_path_factory.mktemp("uncompressed"), {}

    def run(allreduce, mode):
        if (allreduce, mode) not in made:
            name, more, env = f"{allreduce}-{mode}", [], None
            if (allreduce, mode) in TIMELINES:
                more = ["--timeline", str(folder / f"{name}.json"), "--timeline-steps", f"{FIRST}:{LAST}"]
                env = {"TIMELINE_TEST_CLOCK_SKEW_S": f"0,{SKEW_S}"} if allreduce == "ring" else None
            made[allreduce, mode] = train_3_ranks(folder, name, ["--allreduce", allreduce, *MODES[mode], *more], env)
        return made[allreduce, mode]

    run.folder = folder
    return run


@pytest.mark.timeout(500)
@pytest.mark.parametrize("allreduce", ["two-pass", "ring", "gloo"])
def test_overlapped_and_lazy_equal_plain(allreduce, uncompressed):
    plain, overlapped, lazy = (uncompressed(allreduce, mode)[0] for mode in MODES)
    # Lazy updates sum the same buckets and give Adam the same gradients: always the same bits.
    assert all(torch.equal(overlapped[k], lazy[k]) for k in plain)
    if allreduce == "two-pass":
        assert all(torch.equal(plain[k], overlapped[k]) for k in plain)
    else:
        for k in plain:
            assert torch.allclose(plain[k], overlapped[k], rtol=1e-3, atol=1e-4), k


@pytest.mark.timeout(400)
@pytest.mark.parametrize("allreduce", ["two-pass", "ring", "gloo"])
def test_powersgd_with_every_algorithm_and_mode(allreduce, tmp_path):
    compress = ["--compress", "powersgd", "--powersgd-rank", "2", "--powersgd-warmup", "3", "--allreduce", allreduce]
    modes = ("overlapped", "lazy", "plain") if allreduce == "ring" else ("overlapped", "lazy")
    models = {mode: train_3_ranks(tmp_path, mode, [*compress, *MODES[mode]]) for mode in modes}
    overlapped, lazy = models["overlapped"][0], models["lazy"][0]
    # The lazy update only moves each bucket's Adam step: the same compressed sums, the same bits.
    assert all(torch.equal(overlapped[k], lazy[k]) for k in overlapped)
    _, metrics, stdout = models[modes[-1]]
    assert "compress powersgd (rank 2, 3 warm-up steps)" in stdout
    assert metrics["compress"] == "powersgd" and len(metrics["bytes_sent_per_step_by_rank"]) == 3
    # 16 steps, 3 of them uncompressed: well under half of what plain float32 sums send
    plain_bytes = ring.two_pass_bytes_sent if allreduce == "two-pass" else ring.ring_bytes_sent  # gloo: as a ring
    plain = max(plain_bytes(421_642, 4, r, 3) for r in range(3))
    assert metrics["bytes_sent_per_step"] < 0.3 * plain


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "compress,allreduce,mode", [("bf16", "ring", "lazy"), ("fp16", "gloo", "overlapped"), ("fp16", "two-pass", "plain")]
)
def test_16_bit_sums_train_and_send_half_the_bytes(compress, allreduce, mode, tmp_path, uncompressed):
    _, metrics, stdout = train_3_ranks(
        tmp_path, compress, ["--compress", compress, "--allreduce", allreduce, *MODES[mode]]
    )
    _, plain_metrics, _ = uncompressed(allreduce, mode)
    assert f"compress {compress}" in stdout and "sent " in stdout
    # every rank sends half the bytes (fp16: plus one number per bucket for its first scale)
    for sent, plain in zip(metrics["bytes_sent_per_step_by_rank"], plain_metrics["bytes_sent_per_step_by_rank"]):
        assert plain // 2 <= sent <= plain // 2 + 64, (sent, plain)
    assert abs(metrics["test_accuracy"] - plain_metrics["test_accuracy"]) < 0.02


@pytest.mark.timeout(300)
def test_no_overlap_two_pass_sums_on_the_training_thread(uncompressed):
    """(test_timeline.py's check, on the plain two-pass run of 3 ranks: one bucket, summed after backward.)"""
    stdout = uncompressed("two-pass", "plain")[2]
    trace = uncompressed.folder / "two-pass-plain.json"
    assert f"timeline of steps {FIRST}-{LAST} written to {trace}" in stdout
    check_trace(trace, world=3, buckets=1, overlap=False, lazy=False)


@pytest.mark.timeout(300)
def test_overlap_lazy_ring_with_a_skewed_clock(uncompressed, tmp_path):
    """(test_timeline.py's check, on the lazy ring run of 3 ranks, rank 1's clock SKEW_S seconds off;
    then scripts/timeline_summary.py on its trace: every rank's steps and every bucket, and a plot.)"""
    stdout = uncompressed("ring", "lazy")[2]
    trace = uncompressed.folder / "ring-lazy.json"
    assert f"timeline of steps {FIRST}-{LAST} written to {trace}" in stdout
    buckets = len(make_buckets(list(reversed(list(Net().parameters()))), int(float(SMALL[-1]) * 2**20)))
    assert buckets > 2
    check_trace(trace, world=3, buckets=buckets, overlap=True, lazy=True, skews=(0.0, SKEW_S))

    png = tmp_path / "t.png"
    summary = subprocess.run(
        [sys.executable, SUMMARY, str(trace), "--plot", str(png)], capture_output=True, text=True, timeout=60
    )
    assert summary.returncode == 0, summary.stderr
    lines = summary.stdout.splitlines()
    for rank in (0, 1, 2):
        row = next(line for line in lines if line.split()[:2] == [str(rank), str(LAST - FIRST + 1)])
        assert float(row.split()[2]) > 0  # mean step ms
        assert sum(f"rank {rank} bucket" in line for line in lines) == buckets
    assert png.stat().st_size > 10_000


def test_buckets_follow_backward_order():
    params = list(reversed(list(Net().parameters())))
    buckets = make_buckets(params, 64 * 1024)
    assert [p for b in buckets for p in b] == params  # every parameter once, in backward order
    assert len(buckets) > 1
    assert all(sum(p.numel() * 4 for p in b[:-1]) < 64 * 1024 for b in buckets)
