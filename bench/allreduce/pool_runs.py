#!/usr/bin/env python3
"""Pool several runs of bench/allreduce/allreduce.py: is an algorithm slower than gloo, run after run?

One run's sign test treats its repetitions as independent coin tosses, but they share the run's
state (the links' token buckets, TCP windows, what ran just before), so a 1% difference can be
"significant" in one run and reversed in the next. Runs on fresh emulated clusters are
independent. For every world size, size and algorithm this prints:

  - each run's paired median of time / gloo's time (the repetitions ran side by side);
  - in how many runs the algorithm was the faster one, and the sign test's p over runs;
  - the median of the paired ratios of all repetitions of all runs.

    for i in 1 2 3 4 5 6 7 8; do
      sudo python bench/allreduce/allreduce.py --cluster --rate 200mbit --tcp-cc reno --world-sizes 2 \\
        --sizes model,2M,4M --algorithms ring,gloo --iters 41 --results-dir /tmp/runs/run$i
    done
    python bench/allreduce/pool_runs.py /tmp/runs/run*/allreduce-cluster-200mbit-reno.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # bench/common: harness, stats (run directly)
from harness import OneLineParser
from stats import md_head, md_row, p_text, ratios_to_gloo, sign_test_p


def pool(runs: list[dict]) -> list[dict]:
    """One row per (N, size, algorithm) that every run measured side by side with gloo."""
    per_run = [ratios_to_gloo(run["results"]) for run in runs]
    rows = []
    for key in per_run[0]:
        if not all(key in p for p in per_run):
            continue
        medians = [statistics.median(p[key]) for p in per_run]
        faster = sum(m < 1 for m in medians)
        everything = [x for p in per_run for x in p[key]]
        row = dict(world_size=key[0], size=key[1], algorithm=key[2], run_medians=medians, runs_faster=faster)
        row |= dict(runs=len(medians), p=sign_test_p(faster, len(medians)), pooled_median=statistics.median(everything))
        rows.append(row | {"repetitions": len(everything)})
    return rows


def table(rows: list[dict]) -> str:
    names = ["N", "size", "algorithm", "x gloo, run by run (paired median)", "faster in k of n runs"]
    lines = md_head([*names, "sign test over runs", "x gloo, all repetitions pooled"], "rlllrrr")
    for r in rows:
        each, faster = " ".join(f"{m:.3f}" for m in r["run_medians"]), f"{r['runs_faster']}/{r['runs']}"
        pooled = f"{r['pooled_median']:.3f} ({r['repetitions']} repetitions)"
        lines.append(md_row(r["world_size"], r["size"], r["algorithm"], each, faster, p_text(r["p"]), pooled))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = OneLineParser(prog="pool_runs.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="JSON files written by bench/allreduce/allreduce.py (one per run)")
    args = ap.parse_args(argv)
    if len(args.results) < 2:
        ap.error("give at least two runs' JSON files")
    runs = []
    for path in args.results:
        try:
            runs.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            ap.error(f"{path}: cannot read it as a results file ({e.__class__.__name__})")
        if not isinstance(runs[-1], dict) or "results" not in runs[-1]:
            ap.error(f"{path}: not a results file of bench/allreduce/allreduce.py")
    rows = pool(runs)
    if not rows:
        ap.error("no algorithm was measured beside gloo, at the same sizes, in every run")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
