"""The benchmarks' bad arguments: one line, exit code 2, and no results file touched."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    "allreduce: size 0": ("allreduce.py", ["--sizes", "0"], "size '0'"),
    "allreduce: world sizes not numbers": ("allreduce.py", ["--world-sizes", "x"], "comma-separated whole numbers"),
    "allreduce: cluster without a cap": ("allreduce.py", ["--cluster"], "--cluster needs --rate"),
    "allreduce: missing candidate": ("allreduce.py", ["--candidate", "/nonexistent/ring.py"], "no such file"),
    "allreduce: missing ring file": ("allreduce.py", ["--ring-file", "/nonexistent/ring.py"], "no such file"),
    "allreduce: no ranks per host": ("allreduce.py", ["--ranks-per-host", "0"], "--ranks-per-host must be 1..64, got 0"),
    "train_step: no ranks per host": ("train_step.py", ["--ranks-per-host", "0"], "--ranks-per-host must be 1..64"),
    "train_step: unknown --only": ("train_step.py", ["--loopback", "--only", "nosuch"], "unknown configuration"),
    "train_step: bucket size not a number": ("train_step.py", ["--bucket-mb", "x"], "comma-separated numbers"),
    "train_step: unknown model": ("train_step.py", ["--model", "resnet"], "--model"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_benchmark_arguments(case, tmp_path):
    script, args, needle = CASES[case]
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", script), *args, "--results-dir", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=50)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert os.listdir(tmp_path) == []
