"""bench/allreduce/pool_runs.py: pooling runs of the all-reduce benchmark, on results files made up here."""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "bench", "allreduce", "pool_runs.py")


def results_file(path, ring_ms, gloo_ms, size="2M"):
    rows = [
        {"world_size": 2, "size": size, "algorithm": alg, "times_ms": times}
        for alg, times in (("ring", ring_ms), ("gloo", gloo_ms))
    ]
    path.write_text(json.dumps({"results": rows}))
    return str(path)


def pool(*files, real=False):
    """pool_runs.py FILES: main(argv) in this process (its `sys.exit(main())` exits with what main returns,
    or with the SystemExit of its OneLineParser), which spares a Python and its torch import (through
    bench/common/harness.py); real=True runs it as a process of its own, to pin exit code and stderr end to end."""
    if real:
        return subprocess.run([sys.executable, TOOL, *files], capture_output=True, text=True, timeout=30)
    import pool_runs

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = pool_runs.main(list(files))
        except SystemExit as e:
            code = e.code
    return subprocess.CompletedProcess([TOOL, *files], code, out.getvalue(), err.getvalue())


def test_counts_runs_and_pools_repetitions(tmp_path):
    # Runs 1-3: ring 2% slower in every repetition; run 4: 4% faster. Paired medians per run
    # 1.02, 1.02, 1.02, 0.96; the run medians split 3:1 (sign test p = 0.625); pooled over all
    # 12 repetitions the median is 1.02.
    files = [results_file(tmp_path / f"r{i}.json", [102.0, 51.0, 204.0], [100.0, 50.0, 200.0]) for i in range(3)]
    files.append(results_file(tmp_path / "r3.json", [96.0, 48.0, 192.0], [100.0, 50.0, 200.0]))
    r = pool(*files)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("| 2 | 2M | ring |"))
    assert "1.020 1.020 1.020 0.960" in row
    assert "| 1/4 | p=0.62 |" in row
    assert "1.020 (12 repetitions)" in row


def test_a_size_missing_from_one_run_is_left_out(tmp_path):
    a = results_file(tmp_path / "a.json", [1.0], [2.0], size="2M")
    b = results_file(tmp_path / "b.json", [1.0], [2.0], size="4M")
    r = pool(a, b)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "no algorithm was measured beside gloo" in r.stderr


@pytest.mark.parametrize(
    "content, message, real", [("{not json", "cannot read it", True), ('{"x": 1}', "not a results file", False)]
)
def test_a_bad_file_is_one_line_and_exit_2(tmp_path, content, message, real):
    good = results_file(tmp_path / "good.json", [1.0], [1.0])
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    r = pool(good, str(bad), real=real)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr
    assert "Traceback" not in r.stderr


def test_one_run_is_not_enough(tmp_path):
    r = pool(results_file(tmp_path / "only.json", [1.0], [1.0]))
    assert r.returncode == 2 and "at least two runs" in r.stderr
