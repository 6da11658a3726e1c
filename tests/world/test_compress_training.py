"""The trainer with --compress: a stop mid-epoch resumes bit for bit, and a resume with other compression
settings is refused (every algorithm and mode, and the bytes sent: tests/world/test_overlap.py)."""

import subprocess
import sys

import procs
import pytest
import torch
from procs import checkpoint_position, final_digest, wait_for


def interrupted_run(args, checkpoint):
    """Start a local job and kill it all just after its first mid-epoch checkpoint (step 6 or later)."""
    job = procs.popen(
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
    """(powersgd: before the resume, resumes with other compression settings are refused, the checkpoint untouched.)"""
    uncompressed = [
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
    ]
    common = [*uncompressed, "--compress", *compress]
    straight = procs.train(
        [*common, "--checkpoint", str(tmp_path / "a.pt"), "--save-path", str(tmp_path / "a.pth")], timeout=200
    )
    assert straight.returncode == 0, straight.stderr
    checkpoint = tmp_path / "b.pt"
    outputs = ["--checkpoint", str(checkpoint), "--save-path", str(tmp_path / "b.pth")]
    args = [*common, *outputs]
    saved = interrupted_run(args, checkpoint)
    assert saved["epoch"] == 1 and 0 < saved["step"] < 18
    assert len(saved["compression"]) == 2  # every rank's state
    if compress[0] == "powersgd":  # each rank's own error buffers
        assert not torch.equal(saved["compression"][0]["errors"][0], saved["compression"][1]["errors"][0])
        before = checkpoint.read_bytes()
        for changed, needle in (
            (["--compress", "bf16"], "made with --compress powersgd, this run has bf16"),
            ([], "made with --compress powersgd, this run has none"),
            (["--compress", *compress, "--powersgd-rank", "2"], "made with --powersgd-rank 4, this run has 2"),
        ):
            result = procs.train([*uncompressed, *changed, *outputs, "--resume"], timeout=120)
            assert result.returncode == 2, result.stderr
            assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
            assert checkpoint.read_bytes() == before
    resumed = procs.train([*args, "--resume"], timeout=200)
    assert resumed.returncode == 0, resumed.stderr
    assert final_digest(resumed.stdout) == final_digest(straight.stdout)
