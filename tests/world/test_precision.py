"""--precision bf16 in a real job, and the model's layout beside a model saved before it changed
(ranks with different precisions: tests/world/test_faults.py).

A bf16 job keeps every guarantee of the default one: the ranks end with the same parameters, and a
job resumed from a mid-epoch checkpoint ends with the bits of one that never stopped."""

import os
import re

import procs
import pytest
import torch
import torch.nn.functional as F
from checkpoint_watch import Watch
from conftest import REPO
from procs import checkpoint_position, final_digest, wait_for

from utils.learn.data import load_mnist
from utils.learn.model import Net
from utils.setup.precision import refusal, this_cpu

STEPS = 60  # 3,840 images, 64 a step
SMALL = [
    *("--train-subset", "3840", "--test-subset", "1000", "--epochs", "1", "--metrics", ""),
    *("--save-every", "20", "--timeout", "60", "--precision", "bf16"),
]


@pytest.mark.parametrize(
    "kind",
    [
        [],
        ["--allreduce", "ring", "--lazy-update"],
        ["--allreduce", "gloo", "--no-overlap"],
        ["--compress", "powersgd", "--powersgd-warmup", "5"],
        ["--sync-every", "4", "--compress", "bf16"],
    ],
    ids=["two-pass", "ring-lazy", "gloo-plain", "powersgd", "sync-every-4"],
)
def test_a_bf16_job_ends_identical_on_every_rank_and_resumes_bit_for_bit(kind, tmp_path):
    """On a CPU without bf16 units the job is refused in one line (exit 2), before any rank starts."""
    if refusal("bf16", this_cpu()) is not None:
        result = procs.train([*SMALL, *kind, "--checkpoint", str(tmp_path / "c.pt")], timeout=60, cwd=str(tmp_path))
        assert result.returncode == 2 and result.stderr.strip().endswith(refusal("bf16", this_cpu())), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == [], result.stderr
        return
    checkpoint, kept = tmp_path / "c.pt", tmp_path / "at-40.pt"
    ranks = procs.start_ranks(
        2, [*SMALL, *kind, "--checkpoint", str(checkpoint), "--save-path", str(tmp_path / "a.pth")]
    )
    try:  # the epoch's end overwrites it: keep a copy of the one after step 40
        watch = Watch(checkpoint)
        wait_for(lambda: watch.keep_if_at((1, 40), kept), 240, "the checkpoint after step 40")
        straight = procs.wait_all(ranks, timeout=240)
    finally:
        for r in ranks:
            procs.kill_group(r)
    assert [code for code, _, _ in straight] == [0, 0], [err for _, _, err in straight]
    assert "parameters identical on all 2 ranks" in straight[0][1]
    assert float(re.search(r"test accuracy ([\d.]+)%", straight[0][1]).group(1)) > 90.0  # it learns
    assert checkpoint_position(kept) == (1, 40)

    ranks = procs.start_ranks(
        2, [*SMALL, *kind, "--checkpoint", str(kept), "--save-path", str(tmp_path / "b.pth"), "--resume"]
    )
    resumed = procs.wait_all(ranks, timeout=240)
    assert [code for code, _, _ in resumed] == [0, 0], [err for _, _, err in resumed]
    assert "after step 40" in resumed[0][1]
    assert final_digest(resumed[0][1]) == final_digest(straight[0][1])


class OldLayoutNet(Net):
    """The model as it was before the compute issue: the default layout, each ReLU before its pooling."""

    def __init__(self):
        super().__init__()
        self.to(memory_format=torch.contiguous_format)

    def layers(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def test_the_shipped_model_classifies_as_it_did_in_the_old_layout():
    state = torch.load(os.path.join(REPO, "model_state_dict.pth"), weights_only=True)
    assert all(t.is_contiguous() for t in state.values())  # saved in the old layout
    new, old = Net(), OldLayoutNet()
    new.load_state_dict(state)
    old.load_state_dict(state)
    assert new.conv2.weight.is_contiguous(memory_format=torch.channels_last)
    _, _, images, _ = load_mnist(os.path.join(REPO, "data"), test_subset=2000)
    with torch.no_grad():
        a, b = new(images), old(images)
    assert torch.equal(a.argmax(1), b.argmax(1))
    assert torch.allclose(a, b, rtol=0, atol=1e-4), (a - b).abs().max()


def test_eval_of_the_shipped_model_prints_its_accuracy():
    result = procs.train(["--eval", "--model_path", "model_state_dict.pth"], timeout=120, cwd=procs.REPO)
    assert result.returncode == 0, result.stderr
    assert "test accuracy 99.36% (model_state_dict.pth, 10000 images)" in result.stdout
