"""Reading and checking a --timeline trace: the helpers tests/world/test_timeline.py, test_overlap.py and
test_multihost.py share (the window of steps their runs record, the checks a reader relies on)."""

import json
import os
from collections import defaultdict

from procs import REPO

SUMMARY = os.path.join(REPO, "scripts", "timeline_summary.py")
SKEW_S = 5.5
FIRST, LAST = 4, 11


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
