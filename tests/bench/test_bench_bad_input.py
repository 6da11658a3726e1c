"""The benchmarks' bad arguments: one line, exit code 2, no results file touched and no temporary folder left.

Every case runs its driver's main(argv) in this process (the drivers' `sys.exit(main())` exits with
what main returns, or with the SystemExit of its OneLineParser), which spares a Python and a torch
import per case; one case per driver also runs as a real process, so the exit code and the lone
line on stderr stay pinned end to end.
"""

import importlib
import os
import signal
import subprocess
import sys
import tempfile

import pytest
from forker import popen

from utils.setup.launch import supervise

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = {
    "allreduce: size 0": ("allreduce.py", ["--sizes", "0"], "size '0'"),
    "balance: --against no commit": ("balance.py", ["--against", "nosuchrev"], "no commit"),  # (checks as root)
    "balance: a split of 0": ("balance.py", ["--splits", "53:11,5:0"], "--splits"),
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
# one case of each driver as a real process: `python bench/<driver>/<driver>.py ...` end to end
END_TO_END = [
    "allreduce: missing ring file",
    "balance: --against no commit",
    "train_step: unknown --only",
    "time_to_accuracy: bad rate in --rates",
]


def assert_refused(code, stderr, needle, script, results_dir):
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in stderr, stderr
    assert lines[0].startswith(f"{script}: "), lines[0]  # the driver's own name, as argparse prints it
    assert os.listdir(results_dir) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_benchmark_arguments(case, tmp_path, capfd, monkeypatch):
    script, args, needle = CASES[case]
    driver = importlib.import_module(script.removesuffix(".py"))
    monkeypatch.setattr(
        sys, "argv", [os.path.join(REPO, "bench", script.removesuffix(".py"), script)]
    )  # argparse's prog, as when run
    monkeypatch.chdir(REPO)
    scratch, results = tmp_path / "scratch", tmp_path / "results"  # scratch: the drivers' temporary folders
    scratch.mkdir()
    results.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        try:  # what `sys.exit(main())` exits with
            code = driver.main([*args, "--results-dir", str(results)])
        except SystemExit as e:
            code = e.code
    finally:  # run_driver's handlers, had a case got that far, must not outlive it
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    out, err = capfd.readouterr()
    assert out == "", out
    assert os.listdir(scratch) == []  # none left
    assert_refused(code, err, needle, script, results)


@pytest.mark.timeout(120)
def test_bad_benchmark_arguments_end_to_end(tmp_path):
    """The same refusals from real processes (started together, each with its own hard timeout)."""
    jobs = {}
    for case in END_TO_END:
        script, args, _ = CASES[case]
        (tmp_path / script).mkdir()
        jobs[case] = popen(
            [
                sys.executable,
                os.path.join(REPO, "bench", script.removesuffix(".py"), script),
                *args,
                "--results-dir",
                str(tmp_path / script),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    outcome = supervise(list(jobs.values()), timeout=100, grace=None, poll=0.05)  # kills them all on the way out
    assert not outcome.timed_out, outcome.outputs
    for (case, job), (_out, err) in zip(jobs.items(), outcome.outputs):
        script, _, needle = CASES[case]
        assert_refused(job.returncode, err, needle, script, tmp_path / script)
