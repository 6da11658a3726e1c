"""bench/balance/balance_pool.py: runs of bench/balance/balance.py pooled, as a real process, on results files
made here (the numbers are chosen so that each figure is known), and its bad input."""

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "bench", "balance", "balance_pool.py")


def pool(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=50)


def write(path, two):
    path.write_text(json.dumps({"command": "made up", "two": {"seconds": two}}))
    return str(path)


@pytest.mark.timeout(60)
def test_each_run_its_ratios_and_every_round_pooled(tmp_path):
    # run one: 53:11 is the best split on all three rounds, but its best round (5.0) is what makes it
    # best: left out, 56:8 is chosen for that round, so the held-out ratio is worse than the plain one
    one = write(
        tmp_path / "one.json",
        {"--balance": [6.6] * 3, "fixed 53:11": [5.0, 6.3, 6.05], "fixed 56:8": [6.1] * 3, "equal shares": [9.0] * 3},
    )
    two = write(tmp_path / "two.json", {"--balance": [5.0, 7.0], "fixed 53:11": [5.0, 7.0]})
    result = pool(one, two)
    assert result.returncode == 0, result.stderr
    rows = re.findall(r"^\| (\S+) \| (fixed \S+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (\d+) \|$", result.stdout, re.M)
    assert [(os.path.basename(r[0]), r[1], *map(float, r[2:5]), int(r[5])) for r in rows] == [
        ("one.json", "fixed 53:11", round(6.6 / 6.05, 3), round(6.6 / 6.1, 3), round(6.6 / 6.05, 3), 3),
        ("two.json", "fixed 53:11", 1.0, 1.0, 1.0, 2),
    ]
    # the rounds: 6.6/5.0, 6.6/6.3, 6.6/6.05 (slower), 1.0 and 1.0 (not slower); their median 6.6/6.3
    assert f"slower in 3 of 5 rounds; paired median {6.6 / 6.3:.3f}" in result.stdout
    low, high = map(float, re.search(r"95% bootstrap interval ([\d.]+)-([\d.]+)", result.stdout).groups())
    assert 1.0 <= low <= 6.6 / 6.3 <= high <= 6.6 / 5.0 + 0.001  # (printed to 3 places)
    assert "## four" not in result.stdout  # no part four in these runs


@pytest.mark.timeout(60)
def test_part_two_is_pooled_against_the_fast_rank_alone(tmp_path):
    # run one: 53:11 is its best split, faster than alone in both rounds; --balance slower in one
    one = write(
        tmp_path / "one.json",
        {"--balance": [4.2, 3.6], "fixed 53:11": [3.6, 3.5], "fixed 56:8": [3.9, 3.9], "fast rank alone": [4.0, 3.5]},
    )
    two = write(tmp_path / "two.json", {"--balance": [4.4], "fixed 56:8": [4.2], "fast rank alone": [4.0]})
    none = write(tmp_path / "none.json", {"--balance": [4.0], "fixed 56:8": [4.0]})  # no fast rank alone
    result = pool(one, two, none)
    assert result.returncode == 0, result.stderr
    section = result.stdout.split("## two: against the fast rank alone")[1]
    rows = re.findall(r"^\| \S+/(\w+).json \| (fixed \S+) \| ([\d.]+) \| ([\d.]+) \| (\d+) \|$", section, re.M)
    assert rows[0] == ("one", "fixed 53:11", f"{(0.9 + 1.0) / 2:.3f}", f"{(1.05 + 3.6 / 3.5) / 2:.3f}", "2")
    assert rows[1:] == [("two", "fixed 56:8", "1.050", "1.100", "1")]
    # pooled: the splits 0.9, 1.0, 1.05 (one slower than alone); --balance 1.05, 1.029, 1.1 (all three)
    assert "each run's best split, pooled: slower in 1 of 3 rounds; paired median 1.000" in section
    assert "--balance, pooled: slower in 3 of 3 rounds; paired median 1.050" in section


@pytest.mark.timeout(60)
def test_another_column_is_compared_when_asked(tmp_path):
    run = write(tmp_path / "run.json", {"--balance": [9.0], "--balance at abc": [5.5], "fixed 53:11": [5.0]})
    result = pool("--column", "--balance at abc", run)
    assert result.returncode == 0, result.stderr
    assert "slower in 1 of 1 rounds; paired median 1.100" in result.stdout
    # one round leaves no other rounds to choose a split on: no held-out ratio, not the first split's
    assert re.search(r"^\| \S+run.json \| fixed 53:11 \| 1.100 \| - \| 1.100 \| 1 \|$", result.stdout, re.M)


@pytest.mark.timeout(60)
def test_a_file_may_name_its_own_column_for_the_code_pooled(tmp_path):
    one = write(tmp_path / "one.json", {"--balance": [9.0], "--balance at abc": [5.5], "fixed 53:11": [5.0]})
    two = write(tmp_path / "two.json", {"--balance": [6.0], "fixed 53:11": [5.0]})
    result = pool(one + "=--balance at abc", two)
    assert result.returncode == 0, result.stderr
    assert "slower in 2 of 2 rounds; paired median 1.150" in result.stdout  # 1.1 and 1.2, not 1.8
    missing = pool(one + "=--balance at def", two)
    assert missing.returncode == 2 and "no column '--balance at def'" in missing.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["missing", "not json", "no parts", "no fixed split"])
def test_bad_input_gets_one_line_and_exit_code_2(tmp_path, case):
    path = tmp_path / "run.json"
    if case == "not json":
        path.write_text("{")
    elif case == "no parts":
        path.write_text(json.dumps({"results": []}))
    elif case == "no fixed split":
        write(path, {"--balance": [6.0], "equal shares": [9.0]})
    result = pool(str(path))
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("balance_pool.py: error: ")


@pytest.mark.timeout(60)
def test_part_equal_is_pooled_seed_by_seed_and_may_name_its_column(tmp_path):
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"equal": {"time_ratios": {"--balance": [1.01, 1.05, 0.98]}}}))
    two = tmp_path / "two.json"
    two.write_text(json.dumps({"equal": {"time_ratios": {"--balance": [9.0], "--balance at abc": [1.02]}}}))
    result = pool(str(one), f"{two}=--balance at abc")
    assert result.returncode == 0, result.stderr
    section = result.stdout.split("## equal")[1]
    rows = re.findall(r"^\| \S+/(\w+).json \| ([\d.]+) \| (\d+) \|$", section, re.M)
    assert rows == [("one", "1.010", "3"), ("two", "1.020", "1")]
    # the rounds 1.01, 1.05, 0.98 and 1.02 (not two's 9.0): three slower, their median 1.015
    assert "pooled: slower in 3 of 4 rounds; paired median 1.015" in section
    assert "## two" not in result.stdout
