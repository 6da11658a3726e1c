"""--timeline: a Chrome trace of every rank's steps, checked for what a reader of it relies on.

Each run records a window of steps and the test checks, per rank and step: one forward, one
backward and one step span, the optimizer once (once per bucket under --lazy-update), every
bucket's sum inside its step (after its forward began, before its update ended), overlapped sums
handed over during backward and running from then on, and the clock alignment: one rank's clock is set seconds off
(TIMELINE_TEST_CLOCK_SKEW_S), yet on the trace's clock no rank ends a bucket's sum before every
rank has started it (within the measured error), and the estimated offset is the skew within it.
Two of the checks run on tests/world/test_overlap.py's uncompressed 3-rank runs, which record a timeline
for them: --no-overlap two-pass, and --lazy-update ring with a skewed clock (and the summary script).
"""

import os
import subprocess
import sys

import procs
import pytest
from trace_checks import FIRST, LAST, SUMMARY, check_trace

COMMON = [
    "--epochs",
    "1",
    "--test-subset",
    "1000",
    "--train-subset",
    "1280",
    "--metrics",
    "",
    "--timeout",
    "60",
    "--timeline-steps",
    f"{FIRST}:{LAST}",
]


@pytest.mark.timeout(180)
def test_torchrun_gloo_overlap_only_rank_0_names_the_file(tmp_path):
    """Under torchrun every rank gets the same command; gloo's asynchronous sums get rows of their own."""
    trace = tmp_path / "timeline.json"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(procs.free_port()),
        procs.TRAIN,
        *COMMON,
        "--allreduce",
        "gloo",
        "--overlap",  # (on one host it is off by default)
        "--timeline",
        str(trace),
        "--save-path",
        str(tmp_path / "m.pth"),
        "--checkpoint",
        str(tmp_path / "c.pt"),
    ]
    result = procs.run(argv, timeout=150, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr
    spans = check_trace(trace, world=2, buckets=2, overlap=True, lazy=False)
    assert {s["row"] for s in spans[1] if s["name"] == "sum"} == {"gloo-sum-0", "gloo-sum-1"}


@pytest.mark.timeout(60)
def test_summary_of_a_file_that_is_not_a_trace_is_one_line(tmp_path):
    for content in (None, "not json", '{"traceEvents": 3}'):
        path = tmp_path / "t.json"
        if content is not None:
            path.write_text(content)
        for out in ([], ["-o", str(tmp_path / "t.png")], ["--plot", str(tmp_path / "t.png")]):  # (-o: plot_metrics')
            result = subprocess.run(
                [sys.executable, SUMMARY, str(path), *out], capture_output=True, text=True, timeout=30
            )
            assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
            assert "cannot read a trace" in result.stderr and "Traceback" not in result.stderr
        path.unlink(missing_ok=True)
