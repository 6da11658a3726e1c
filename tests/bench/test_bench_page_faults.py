"""bench/balance/page_faults.py: four runs a round, each a real process (a table a row a run), and its bad
arguments (one line, exit code 2). Whether the limits keep the faults away: tests/world/test_memory.py."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "bench", "balance", "page_faults.py")


@pytest.mark.timeout(180)
def test_a_row_for_each_malloc_and_plan_with_its_time_and_faults_a_step():
    argv = [sys.executable, TOOL, "--rounds", "1", "--steps", "10"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stderr
    rows = re.findall(
        r"^\| (as it comes|limits set) \| ([^|]+) \| ([\d.]+) \| (\d+) \| [\d.]+ ms \d+ \|$", result.stdout, re.M
    )
    assert [(r[0], r[1].strip()) for r in rows] == [
        (malloc, plan)
        for malloc in ("as it comes", "limits set")
        for plan in ("56 from the start", "32 for 10 steps, then 56")
    ], result.stdout
    assert all(float(ms) > 0 for _, _, ms, _ in rows)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args", [["--rounds", "0"], ["--steps", "0"], ["--run", "56:1"], ["--run", "56 from the start:2"]]
)
def test_bad_arguments_get_one_line_and_exit_code_2(args):
    result = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=50)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("page_faults.py: ")
