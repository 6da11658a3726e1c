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
    "allreduce: no ranks per host": (
        "allreduce.py",
        ["--ranks-per-host", "0"],
        "--ranks-per-host must be 1..64, got 0",
    ),
    "train_step: no ranks per host": ("train_step.py", ["--ranks-per-host", "0"], "--ranks-per-host must be 1..64"),
    "train_step: unknown --only": ("train_step.py", ["--loopback", "--only", "nosuch"], "unknown configuration"),
    "train_step: bucket size not a number": ("train_step.py", ["--bucket-mb", "x"], "comma-separated numbers"),
    "train_step: unknown model": ("train_step.py", ["--model", "resnet"], "--model"),
    "train_step: unknown compression": ("train_step.py", ["--compression", "--compress", "int8"], "--compress"),
    "train_step: compress with no config": ("train_step.py", ["--compress-with", "ring+lazy"], "--compress-with"),
    "train_step: PowerSGD warm-up too short": ("train_step.py", ["--powersgd-warmup", "1"], ">= 2"),
    "time_to_accuracy: unknown configuration": ("time_to_accuracy.py", ["--configs", "ours,horovod"], "horovod"),
    "time_to_accuracy: bad --ours": ("time_to_accuracy.py", ["--ours", "ring+lazy"], "--ours"),
    "time_to_accuracy: target above 1": ("time_to_accuracy.py", ["--target", "99"], "fraction"),
    "time_to_accuracy: epochs 0": ("time_to_accuracy.py", ["--epochs", "0"], "must be > 0"),
    "time_to_accuracy: bad rate": ("time_to_accuracy.py", ["--rate", "fast"], "fast"),
    "time_to_accuracy: subset below a step": ("time_to_accuracy.py", ["--train-subset", "10"], "one step"),
    "time_to_accuracy: world of one": ("time_to_accuracy.py", ["--world-sizes", "1,2"], ">= 2"),
    "time_to_accuracy: local SGD without a period": ("time_to_accuracy.py", ["--configs", "localsgd"], "localsgd@H"),
    "time_to_accuracy: PowerSGD every H steps": ("time_to_accuracy.py", ["--configs", "ours+powersgd@8"], "powersgd"),
    "time_to_accuracy: --rate and --rates": (
        "time_to_accuracy.py",
        ["--rate", "1gbit", "--rates", "20mbit"],
        "not allowed with",
    ),
    "time_to_accuracy: bad rate in --rates": ("time_to_accuracy.py", ["--rates", "20mbit,fast"], "fast"),
    "time_to_accuracy: outer lr without nesterov": ("time_to_accuracy.py", ["--outer-lr", "0.5"], "--outer nesterov"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_benchmark_arguments(case, tmp_path):
    script, args, needle = CASES[case]
    r = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", script), *args, "--results-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert os.listdir(tmp_path) == []
