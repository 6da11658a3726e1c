"""A NaN stops the job, not the run's good files: a non-finite loss on one rank rides with that step's
sum to every rank, and a save finds non-finite parameters itself; every rank stops at the same step with
one line and exit code 4, and the model file, its digest and the checkpoint on disk stay the last good
ones. Real ranks, each its own process; the NaN put in by RING_INSTRUMENTS's NAN and NANGRAD faults
(utils/observe/instruments.py)."""

import hashlib
import re
import shutil

import procs
import pytest
import torch

from utils.observe.instruments import environ_for
from utils.store import checkpoint

NOT_FINITE = 4
STEPS = 20  # 1280 images, 64 a step
ARGS = ["--epochs", "2", "--train-subset", "1280", "--test-subset", "200", "--save-every", "5", "--timeout", "30"]


def run_ranks(folder, fault, resume=True, extra=()):
    """Both ranks of the job in `folder`, RING_INSTRUMENTS's `fault` in their environment; [(code, out, err)]."""
    args = [*ARGS, *extra, "--checkpoint", "c.pt", "--save-path", "m.pth", "--metrics", "m.jsonl"]
    ranks = procs.start_ranks(2, [*args, *(["--resume"] if resume else [])], cwd=folder, env=environ_for(faults=fault))
    return procs.wait_all(ranks, timeout=90)


def digests(folder):
    return {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in ("c.pt", "m.pth", "m.pth.sha256")
    }


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A job stopped by SIGTERM in epoch 2, after step 8 (a model of epoch 1 and a checkpoint of step 5
    before it, both good): its folder, and the sha256 of its files."""
    folder = tmp_path_factory.mktemp("job")
    results = run_ranks(folder, f"0:{STEPS + 8}:TERM", resume=False)
    assert [code for code, _, _ in results] == [3, 3], [err for _, _, err in results]
    assert (
        torch.load(folder / "c.pt", weights_only=True)["epoch"],
        torch.load(folder / "c.pt", weights_only=True)["step"],
    ) == (2, 8)
    return folder, digests(folder)


def one_line_each(results):
    """Every rank's one line (its whole stderr), after exit code 4."""
    assert [code for code, _, _ in results] == [NOT_FINITE, NOT_FINITE], [err for _, _, err in results]
    lines = [err.strip().splitlines() for _, _, err in results]
    assert all(len(said) == 1 for said in lines), lines
    for rank, (said,) in enumerate(lines):
        assert said.startswith(f"train.py: rank {rank}: ") and "nothing was saved after it" in said, said
        assert "m.pth and c.pt are kept as they were" in said and said.endswith("--resume"), said
        assert "Traceback" not in said
    return [said for (said,) in lines]


def files_kept(folder, before):
    assert digests(folder) == before  # nothing saved over them
    loaded = checkpoint.safe_load(str(folder / "c.pt"))
    assert checkpoint.check_digest(loaded, str(folder / "c.pt"))  # it has its digest, and it matches
    assert checkpoint.not_finite(loaded) is None and (loaded["epoch"], loaded["step"]) == (2, 8)
    assert checkpoint.check_model_file(str(folder / "m.pth"))
    assert checkpoint.not_finite(torch.load(folder / "m.pth", weights_only=True)) is None


@pytest.mark.timeout(150)
def test_one_rank_s_nan_loss_stops_every_rank_at_its_step(good):
    """Rank 1's loss turns NaN at epoch 2, step 9 (before the save of step 10); rank 0's is finite there,
    and it stops at the same step all the same: the flag rode with the step's sum."""
    folder, before = good
    lines = one_line_each(run_ranks(folder, f"1:{STEPS + 9}:NAN"))
    assert all("the loss turned non-finite at epoch 2, step 9 " in said for said in lines), lines
    assert "(another rank's)" in lines[0] and "(this rank's: nan)" in lines[1], lines
    files_kept(folder, before)


@pytest.mark.timeout(150)
def test_a_save_refuses_non_finite_parameters_on_every_rank(good):
    """A NaN in rank 1's gradient at epoch 2, step 10 (its loss finite): the sum spreads it, and the save
    after that step (--save-every 5) finds the parameters non-finite, on both ranks; nothing is written."""
    folder, before = good
    lines = one_line_each(run_ranks(folder, f"1:{STEPS + 10}:NANGRAD"))
    assert all(re.search(r"the parameters are not finite after epoch 2, step 10 \(model\.\S+ holds", s) for s in lines)
    files_kept(folder, before)


@pytest.mark.timeout(150)
def test_the_epoch_s_end_writes_no_nan_model(good, tmp_path):
    """A NaN in rank 1's gradient at the last step of the last epoch: the epoch's end (rank 0's model
    file, the final checkpoint) finds it on both ranks. The model file stays epoch 1's; the checkpoint
    is the last good one, of --save-every's step 15."""
    folder, before = good
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)  # (the other tests' files stay as they were)
    lines = one_line_each(run_ranks(tmp_path, f"1:{2 * STEPS}:NANGRAD"))
    assert all(f"the parameters are not finite after epoch 2, step {STEPS} (" in said for said in lines), lines
    after = digests(tmp_path)
    assert after["m.pth"] == before["m.pth"] and after["m.pth.sha256"] == before["m.pth.sha256"]
    saved = checkpoint.safe_load(str(tmp_path / "c.pt"))
    assert checkpoint.check_digest(saved, "c.pt") and checkpoint.not_finite(saved) is None
    assert (saved["epoch"], saved["step"]) == (2, 15)


@pytest.mark.timeout(150)
def test_a_survivor_saves_no_nan_over_the_checkpoint(good, tmp_path):
    """--no-recover: rank 1 puts a NaN in its gradient at epoch 2, step 9, and is killed as step 10
    begins; rank 0, the survivor that saves the last step it completed, finds it non-finite and keeps
    the checkpoint as it was."""
    folder, before = good
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    results = run_ranks(tmp_path, f"1:{STEPS + 9}:NANGRAD,1:{STEPS + 10}:KILL", extra=["--no-recover"])
    assert results[1][0] < 0 and results[0][0] == 1, [err for _, _, err in results]
    said = results[0][2].strip().splitlines()
    assert (
        len(said) == 1
        and "the parameters of epoch 2, step 9 are not finite: nothing saved (c.pt kept as it was)" in said[0]
    ), said
    assert digests(tmp_path) == before
