"""--timeline: a Chrome trace of every rank's steps, checked for what a reader of it relies on.

Each run records a window of steps and the test checks, per rank and step: one forward, one
backward and one step span, the optimizer once (once per bucket under --lazy-update), every
bucket's sum inside its step (after its forward began, before its update ended), overlapped sums
handed over during backward and running from then on, and the clock alignment: one rank's clock is set seconds off
(TIMELINE_TEST_CLOCK_SKEW_S), yet on the trace's clock no rank ends a bucket's sum before every
rank has started it (within the measured error), and the estimated offset is the skew within it.
Two of the checks run on tests/test_overlap.py's uncompressed 3-rank runs, which record a timeline
for them: --no-overlap two-pass, and --lazy-update ring with a skewed clock (and the summary script).
"""

import json
import os
import subprocess
import sys
from collections import defaultdict

import procs
import pytest
from procs import REPO

SUMMARY = os.path.join(REPO, "scripts", "timeline_summary.py")
SKEW_S = 5.5
FIRST, LAST = 4, 11
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


def load_spans(path):
    """({rank: [dict(name, row, start, end, args)]}, otherData), times in µs on rank 0's clock."""
    with open(path) as f:
        trace = json.load(f)
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    spans = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            spans[e["pid"]].append(
                dict(
                    name=e["name"], row=rows[e["pid"], e["tid"]], start=e["ts"], end=e["ts"] + e["dur"], args=e["args"]
                )
            )
    return dict(spans), trace["otherData"]


def check_trace(path, world, buckets, overlap, lazy, skews=(0.0,)):
    spans, meta = load_spans(path)
    assert sorted(spans) == list(range(world))
    assert (meta["first_step"], meta["last_step"], meta["world_size"]) == (FIRST, LAST, world)
    errors_us = [e / 1e3 for e in meta["clock_error_ns"]]
    for rank in range(world):  # the estimated offset undoes the skew, within the measured error
        skew_ns = skews[rank % len(skews)] * 1e9
        assert abs(meta["clock_offset_ns"][rank] + skew_ns) <= meta["clock_error_ns"][rank] + 1e3, meta
    for rank, mine in spans.items():
        training = [s for s in mine if s["row"] == "training"]
        for step in range(FIRST, LAST + 1):

            def of(name, among=training, step=step):
                return [s for s in among if s["name"] == name and s["args"]["step"] == step]

            assert [len(of(n)) for n in ("step", "forward", "backward")] == [1, 1, 1], (rank, step)
            (forward,), (backward,) = of("forward"), of("backward")
            updates = of("optimizer", mine)
            assert len(updates) == (buckets if lazy else 1), (rank, step, updates)
            sums = of("sum", mine)
            assert sorted(s["args"]["bucket"] for s in sums) == list(range(buckets)), (rank, step, sums)
            ready = {s["args"]["bucket"]: s for s in of("ready")}
            for s in sums:
                assert forward["start"] <= s["start"] and s["end"] <= max(u["end"] for u in updates), (rank, s)
                if overlap:  # handed to its thread (or to gloo) inside backward, summed from then on
                    hand_over = ready[s["args"]["bucket"]]["start"]
                    assert s["row"] != "training", (rank, s)
                    assert backward["start"] <= hand_over <= backward["end"], (rank, s, backward, hand_over)
                    assert hand_over <= s["start"] + 1, (rank, s, hand_over)
                else:
                    assert s["start"] >= backward["end"] and s["row"] == "training", (rank, s, backward)
    slack_us = sum(errors_us) + 1  # the clocks' errors, and the trace's rounding to ns
    for step in range(FIRST, LAST + 1):
        for bucket in range(buckets):
            sums = [
                next(
                    s
                    for s in spans[r]
                    if s["name"] == "sum" and s["args"]["step"] == step and s["args"]["bucket"] == bucket
                )
                for r in range(world)
            ]
            assert max(s["start"] for s in sums) <= min(s["end"] for s in sums) + slack_us, (step, bucket, sums)
    return spans


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
