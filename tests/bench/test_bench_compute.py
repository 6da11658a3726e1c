"""bench/compute/compute.py end to end, short (--short: a few steps, epochs of 1,280 images): every part's
table and results file, the default baseline's old path, the baseline's worktree removed afterwards, and
bad arguments."""

import json
import re
import subprocess
import sys

import procs
import pytest
from conftest import REPO

from utils.setup.precision import refusal, this_cpu

TOOL = f"{REPO}/bench/compute/compute.py"
# bf16 is measured where train.py allows it (utils/setup/precision.py): elsewhere its variants are absent
BF16 = ("bf16",) if refusal("bf16", this_cpu()) is None else ()


@pytest.mark.timeout(400)
def test_every_part_measures_every_variant_and_leaves_no_worktree(tmp_path):
    before = subprocess.run(["git", "-C", REPO, "worktree", "list"], capture_output=True, text=True).stdout
    # the baseline: HEAD, which every clone has (the default, a commit of before issue 60, needs the history)
    result = procs.run(
        [sys.executable, TOOL, "--short", "--rounds", "1", "--baseline", "HEAD", "--out", str(tmp_path)], 360
    )
    assert result.returncode == 0, result.stderr
    found = json.loads((tmp_path / "compute.json").read_text())["medians"]
    assert set(found) == {
        "ceiling/machine",
        *(f"step/{v}" for v in ("old", "default", *BF16, "examples")),
        *(f"eval/{v}" for v in ("old", "default", *BF16)),
        *(f"epoch/{v}" for v in ("old", "default", *BF16, "ddp")),
    }
    assert ("mm_bf16" in found["ceiling/machine"]) == bool(BF16)
    assert all(value > 0 for value in found["ceiling/machine"].values())
    assert all(found[f"step/{v}"]["ms"] > 0 for v in ("old", "default", *BF16, "examples"))
    for variant in ("old", "default", *BF16, "ddp"):  # 20 steps of 64 images learn something
        assert 0.5 < found[f"epoch/{variant}"]["accuracy"] <= 1.0, found
    assert found["epoch/old"]["accuracy"] == found["epoch/default"]["accuracy"]  # the baseline is HEAD here
    table = (tmp_path / "compute.md").read_text()
    assert re.search(r"^\| default \| [\d.]+ \| [\d,]+ \| [\d.]+ \| \d+% \| [\d.]+ \|$", table, re.M), table
    after = subprocess.run(["git", "-C", REPO, "worktree", "list"], capture_output=True, text=True).stdout
    assert after == before


@pytest.mark.timeout(150)
def test_the_default_baseline_runs_the_old_path_from_its_own_module_names(tmp_path):
    """The default baseline (edb07fe) keeps its modules where they were then (utils/model.py...): its
    workers find them there, not under today's names."""
    before = subprocess.run(["git", "-C", REPO, "worktree", "list"], capture_output=True, text=True).stdout
    result = procs.run(
        [sys.executable, TOOL, "--short", "--rounds", "1", "--parts", "step", "--out", str(tmp_path)], 130
    )
    assert result.returncode == 0, result.stderr
    found = json.loads((tmp_path / "compute-step.json").read_text())
    assert found["baseline"] == "edb07fe"
    assert set(found["medians"]) == {f"step/{v}" for v in ("old", "default", *BF16, "examples")}
    assert all(r["ms"] > 0 for r in found["medians"].values())
    after = subprocess.run(["git", "-C", REPO, "worktree", "list"], capture_output=True, text=True).stdout
    assert after == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["--parts", "step,x"], ["--rounds", "0"], ["--rounds", "x"]])
def test_bad_arguments_get_one_line_and_exit_code_2(args):
    result = procs.run([sys.executable, TOOL, *args], 50)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("bench/compute/compute.py: error")
