"""A damaged file is refused as a new user meets it, from the command line: a checkpoint with bytes
flipped inside a tensor and the command a stopped job printed to resume it; a model file with bytes
flipped inside a tensor, beside its digest, under --eval, --model_path and the local launcher. Each is
one line and exit code 2, and the files are left as they were; without a digest a file loads, with one
line that says it could not be checked (utils/store/checkpoint.py)."""

import os
import re
import shlex
import sys

import procs
import pytest
import torch
from damage import flip_inside
from procs import TRAIN

from utils.observe.instruments import environ_for

ARGS = ["--epochs", "2", "--train-subset", "1280", "--test-subset", "200", "--timeout", "30"]
ARGS += ["--checkpoint", "c.pt", "--save-path", "m.pth", "--metrics", "m.jsonl"]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A job of 2 ranks stopped by SIGTERM in epoch 2 (exit 3): its folder, and the command it printed."""
    folder = tmp_path_factory.mktemp("job")
    env = dict(os.environ, **environ_for(faults="0:25:TERM"))
    result = procs.train(ARGS, timeout=90, cwd=folder, env=env)
    assert result.returncode == 3 and "stopped after epoch 2, step 5/20" in result.stderr, result.stderr
    command = re.search(r"to resume: (.*)$", result.stderr.strip().splitlines()[-1]).group(1)
    return folder, shlex.split(command)


def one_line(result, *needles):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stdout + result.stderr, result.stderr
    assert all(needle in lines[0] for needle in needles), lines[0]


def files(folder):
    return {name: (folder / name).read_bytes() for name in ("c.pt", "m.pth", "m.pth.sha256")}


@pytest.mark.timeout(120)
def test_a_damaged_checkpoint_is_refused_by_the_resume_command(stopped):
    folder, command = stopped
    saved = torch.load(folder / "c.pt", weights_only=True)
    before = flip_inside(folder / "c.pt", saved["model"]["fc1.weight"])
    damaged = files(folder)
    assert command[:3] == ["python3", "-u", "train.py"], command
    result = procs.run([sys.executable, "-u", TRAIN, *command[3:]], 60, cwd=folder)  # (that python, that train.py)
    one_line(result, "train.py: error: checkpoint c.pt is damaged: its digest says sha256", "nothing was loaded")
    assert files(folder) == damaged  # nothing overwritten, the damaged file kept for a look
    (folder / "c.pt").write_bytes(before)


@pytest.mark.timeout(120)
def test_a_damaged_model_file_is_refused_wherever_it_is_read(stopped, tmp_path):
    folder, _ = stopped
    model = tmp_path / "m.pth"
    model.write_bytes((folder / "m.pth").read_bytes())
    (tmp_path / "m.pth.sha256").write_bytes((folder / "m.pth.sha256").read_bytes())
    flip_inside(model, torch.load(model, weights_only=True)["fc1.weight"])
    damaged = model.read_bytes()
    out = ["--save-path", str(tmp_path / "out.pth"), "--checkpoint", str(tmp_path / "out.pt")]
    rank_0 = ["--rank", "0", "--world-size", "1", "--init-method", f"tcp://127.0.0.1:{procs.free_port()}"]
    rank_0 += ["--gloo_socket_ifname", "lo"]
    for args in (
        ["--eval", "--model_path", str(model)],  # evaluating it
        ["--model_path", str(model), *out, *rank_0],  # rank 0 training from it
        ["--model_path", str(model), *out, "--nproc", "2"],  # the local launcher, before any rank starts
    ):
        result = procs.train([*args, "--test-subset", "200", "--train-subset", "1280"], timeout=60, cwd=tmp_path)
        one_line(result, f"model file {model} does not match its digest", f"{model}.sha256 says sha256")
    assert model.read_bytes() == damaged and not (tmp_path / "out.pth").exists()


@pytest.mark.timeout(120)
def test_files_without_a_digest_load_with_one_line(stopped, tmp_path):
    """A model from elsewhere (no .sha256 beside it) evaluates; a checkpoint older than digests resumes,
    and the run finishes. Each says once that it could not be checked."""
    folder, _ = stopped
    model = tmp_path / "m.pth"
    model.write_bytes((folder / "m.pth").read_bytes())
    evaluated = procs.train(["--eval", "--model_path", str(model), "--test-subset", "200"], timeout=60, cwd=tmp_path)
    assert evaluated.returncode == 0 and "test accuracy" in evaluated.stdout, evaluated.stderr
    said = f"warning: model file {model} has no digest beside it ({model}.sha256): it could not be checked\n"
    assert evaluated.stderr == said
    old = torch.load(folder / "c.pt", weights_only=True)
    del old["digest"]  # as the program wrote it before digests
    torch.save(old, tmp_path / "c.pt")
    resumed = procs.train([*ARGS, "--resume"], timeout=90, cwd=tmp_path)
    assert resumed.returncode == 0 and "resuming from c.pt: epoch 2, after step 5" in resumed.stdout, resumed.stderr
    assert resumed.stderr.count("it could not be checked") == 1, resumed.stderr
    assert "warning: checkpoint c.pt has no digest (it is older than digests)" in resumed.stderr
    assert "digest" in torch.load(tmp_path / "c.pt", weights_only=True)  # the checkpoints it saved have one
