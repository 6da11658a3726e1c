"""Resuming on another number of ranks: the same global batch, data order, schedule and books.

Bits are not expected to survive a resize (the sums add in another order); the step after it must
match the unresized run's within float tolerance, and the job must end about as accurate.
"""

import re

import procs
import pytest
import torch
from checkpoint_watch import Watch
from procs import checkpoint_position, wait_for

STEPS = 10
# 1,000 test images, not 10,000 (evaluating those costs more than the 10 steps): the one step after the
# resize leaves the parameters within 1e-4, so both runs classify the same; 0.1 point is one image here
SMALL = [
    *("--train-subset", "640", "--test-subset", "1000", "--epochs", "1", "--metrics", ""),
    *("--save-every", str(STEPS - 1), "--timeout", "30"),
]


def parameters(path):
    return torch.cat([t.reshape(-1) for t in torch.load(path, weights_only=True).values()])


def accuracy(stdout):
    return float(re.search(r"test accuracy ([\d.]+)%", stdout).group(1))


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "before, after, extra",
    [(2, 3, ["--compress", "powersgd", "--powersgd-warmup", "2"]), (3, 2, ["--lazy-update"])],
    ids=["2-to-3-powersgd", "3-to-2-lazy"],
)
def test_the_step_after_a_resize_matches_the_unresized_run(before, after, extra, tmp_path):
    """The unresized run saves before its last step; that checkpoint resumes on another number of ranks
    for that one step. Its parameters must match the unresized run's end within float tolerance."""
    checkpoint, kept = tmp_path / "c.pt", tmp_path / "before-last-step.pt"
    ranks = procs.start_ranks(
        before, [*SMALL, *extra, "--checkpoint", str(checkpoint), "--save-path", str(tmp_path / "unresized.pth")]
    )
    try:  # the epoch's end (after evaluating) overwrites it: keep a copy first
        watch = Watch(checkpoint)
        wait_for(lambda: watch.keep_if_at((1, STEPS - 1), kept), 240, "the checkpoint before the last step")
        unresized = procs.wait_all(ranks, timeout=240)
    finally:
        for r in ranks:
            procs.kill_group(r)
    assert [code for code, _, _ in unresized] == [0] * before, [err for _, _, err in unresized]
    assert checkpoint_position(kept) == (1, STEPS - 1)

    ranks = procs.start_ranks(
        after, [*SMALL, *extra, "--checkpoint", str(kept), "--save-path", str(tmp_path / "resized.pth"), "--resume"]
    )
    resized = procs.wait_all(ranks, timeout=240)
    assert [code for code, _, _ in resized] == [0] * after, [err for _, _, err in resized]
    out = resized[0][1]
    assert (
        f"resuming from {kept}: epoch 1, after step {STEPS - 1}; resuming on {after} ranks; "
        f"the checkpoint was made on {before}"
    ) in out, out
    assert f"batch 64 ({'32' if after == 2 else '21-22'} per rank)" in out
    a, b = parameters(tmp_path / "unresized.pth"), parameters(tmp_path / "resized.pth")
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (a - b).abs().max()
    assert abs(accuracy(out) - accuracy(unresized[0][1])) <= 0.1
