"""The trainer with --compress: every algorithm and mode, the bytes it reports, exact resume, refusals."""

import json
import subprocess
import sys

import procs
import pytest
import torch
from procs import checkpoint_position, final_digest, wait_for

from utils.comm import ring

SMALL = ["--test-subset", "1000", "--train-subset", "960", "--epochs", "1", "--bucket-mb", "0.05"]
MODES = {"plain": ["--no-overlap"], "overlapped": ["--overlap"], "lazy": ["--overlap", "--lazy-update"]}


def train_3_ranks(tmp_path, name, args):
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
    )
    results = procs.wait_all(ranks, timeout=150)
    assert [code for code, _, _ in results] == [0, 0, 0], [err for _, _, err in results]
    assert "parameters identical on all 3 ranks" in results[0][1]
    metrics = json.loads((tmp_path / f"{name}.jsonl").read_text().splitlines()[-1])
    return torch.load(tmp_path / f"{name}.pth", weights_only=True), metrics, results[0][1]


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
def test_16_bit_sums_train_and_send_half_the_bytes(compress, allreduce, mode, tmp_path):
    _, metrics, stdout = train_3_ranks(
        tmp_path, compress, ["--compress", compress, "--allreduce", allreduce, *MODES[mode]]
    )
    _, plain_metrics, _ = train_3_ranks(tmp_path, "none", ["--allreduce", allreduce, *MODES[mode]])
    assert f"compress {compress}" in stdout and "sent " in stdout
    # every rank sends half the bytes (fp16: plus one number per bucket for its first scale)
    for sent, plain in zip(metrics["bytes_sent_per_step_by_rank"], plain_metrics["bytes_sent_per_step_by_rank"]):
        assert plain // 2 <= sent <= plain // 2 + 64, (sent, plain)
    assert abs(metrics["test_accuracy"] - plain_metrics["test_accuracy"]) < 0.02


def interrupted_run(args, checkpoint):
    """Start a local job and kill it all just after its first mid-epoch checkpoint (step 6 or later)."""
    job = subprocess.Popen(
        [sys.executable, procs.TRAIN, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(lambda: (checkpoint_position(checkpoint) or (0, 0)) >= (1, 6), 120, "a mid-epoch checkpoint")
        procs.kill_group(job)
        job.communicate(timeout=30)
    finally:
        procs.kill_group(job)
    return torch.load(checkpoint, weights_only=True)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("compress", [["powersgd", "--powersgd-warmup", "2"], ["fp16"]])
def test_resume_mid_epoch_with_compression_is_bit_identical(compress, tmp_path):
    common = [
        "--test-subset",
        "1000",
        "--train-subset",
        "1200",
        "--metrics",
        "",
        "--epochs",
        "2",
        "--save-every",
        "3",
        "--lazy-update",
        "--compress",
        *compress,
    ]
    straight = procs.train(
        [*common, "--checkpoint", str(tmp_path / "a.pt"), "--save-path", str(tmp_path / "a.pth")], timeout=200
    )
    assert straight.returncode == 0, straight.stderr
    checkpoint = tmp_path / "b.pt"
    args = [*common, "--checkpoint", str(checkpoint), "--save-path", str(tmp_path / "b.pth")]
    saved = interrupted_run(args, checkpoint)
    assert saved["epoch"] == 1 and 0 < saved["step"] < 18
    assert len(saved["compression"]) == 2  # every rank's state
    if compress[0] == "powersgd":  # each rank's own error buffers
        assert not torch.equal(saved["compression"][0]["errors"][0], saved["compression"][1]["errors"][0])
    resumed = procs.train([*args, "--resume"], timeout=200)
    assert resumed.returncode == 0, resumed.stderr
    assert final_digest(resumed.stdout) == final_digest(straight.stdout)


@pytest.mark.timeout(200)
def test_resume_refuses_a_different_compression(tmp_path):
    checkpoint = tmp_path / "c.pt"
    common = [
        "--test-subset",
        "1000",
        "--train-subset",
        "1200",
        "--epochs",
        "2",
        "--metrics",
        "",
        "--save-every",
        "3",
        "--checkpoint",
        str(checkpoint),
        "--save-path",
        str(tmp_path / "m.pth"),
    ]
    interrupted_run([*common, "--compress", "powersgd"], checkpoint)
    before = checkpoint.read_bytes()
    for changed, needle in (
        (["--compress", "bf16"], "made with --compress powersgd, this run has bf16"),
        ([], "made with --compress powersgd, this run has none"),
        (["--compress", "powersgd", "--powersgd-rank", "2"], "made with --powersgd-rank 4, this run has 2"),
    ):
        result = procs.train([*common, *changed, "--resume"], timeout=120)
        assert result.returncode == 2, result.stderr
        assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert checkpoint.read_bytes() == before
