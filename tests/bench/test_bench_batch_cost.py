"""bench/balance/batch_cost.py: a step's CPU time by batch size, as a real process (a table a row a size),
and its bad arguments (one line, exit code 2)."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "bench", "balance", "batch_cost.py")


@pytest.mark.timeout(120)
def test_a_row_for_each_size_with_its_time_a_step_and_an_image():
    result = subprocess.run(
        [sys.executable, TOOL, "--sizes", "16,4", "--rounds", "2", "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stderr
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+), ([\d.]+) \| ([\d.]+) \|$", result.stdout, re.M)
    assert [int(r[0]) for r in rows] == [4, 16], result.stdout  # sorted by size, two rounds each
    for images, ms, *_, per_image in rows:
        assert float(ms) > 0 and float(per_image) == pytest.approx(
            float(ms) / int(images), abs=0.05 / int(images) + 0.001
        )  # (ms rounded)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["--sizes", "8,x"], ["--sizes", "0"], ["--rounds", "0"], ["--steps", "2"]])
def test_bad_arguments_get_one_line_and_exit_code_2(args):
    result = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=50)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("batch_cost.py: ")
