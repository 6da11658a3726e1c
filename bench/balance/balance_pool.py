#!/usr/bin/env python3
"""Pool runs of bench/balance/balance.py: --balance against the best fixed split, run after run.

A run's verdict, the median of its --balance epochs over the median of its best fixed split's,
moves by 5-10% from one hour to the next, and choosing the best of several splits on the same
rounds it is then compared on flatters that split. For each part (two, four) this prints:

  - each run's ratio as bench/balance/balance.py reports it (the split chosen on all the rounds);
  - the same with the split chosen on the other rounds, one round left out at a time;
  - each run's paired median: every round's --balance epoch over that round's epoch at the run's
    best split (both ran in the same round, under the same load);
  - pooled over every round of every run: how many --balance was slower in, the median of the
    paired ratios and a 95% bootstrap interval of that median (resampled rounds, seeded);

and for part two against the fast rank alone, and part equal (2 epochs on equal servers, seed by
seed) against equal shares, each run's median and every round's ratio pooled.

    for i in 1 2 3; do
      sudo python bench/balance/balance.py --only two --only four --reps 8 \\
        --splits 53:11,56:8,37:17:9:1,40:16:7:1 --results-dir /tmp/balance/run$i
    done
    python bench/balance/balance_pool.py /tmp/balance/run*/balance-two-four.json
    python bench/balance/balance_pool.py --column '--balance at f9f8a6f' \\
        bench/results/balance/first-look-two-four-change.json

A file given as FILE=COLUMN is read with its COLUMN in the place of --column's: one code pooled
over runs where it had different names (main in one, a trial in another).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # bench/common: harness, stats (run directly)
from harness import OneLineParser
from stats import fmt, md_head, md_row, paired_ratios, quantile

PARTS = ("two", "four")  # against fixed splits; part equal against equal shares (its time_ratios)
RESAMPLES = 10_000


def run_ratios(seconds: dict[str, list[float]], column: str) -> dict | None:
    """One run's part: its ratios to the best fixed split, or None if it has no such column or
    no fixed split. seconds: {configuration: [epoch seconds, round by round]}."""
    fixed = fixed_splits(seconds)
    if column not in seconds or not fixed:
        return None
    rounds = min(len(seconds[column]), *(len(times) for times in fixed.values()))
    ours, fixed = seconds[column][:rounds], {name: times[:rounds] for name, times in fixed.items()}
    best = fastest(fixed)
    left_out = []  # round i at the split that was fastest over the other rounds (none with one round)
    for i in range(rounds if rounds > 1 else 0):
        others = {name: times[:i] + times[i + 1 :] for name, times in fixed.items()}
        chosen = fastest(others)
        left_out.append(fixed[chosen][i])
    paired = paired_ratios(ours, fixed[best])
    return dict(
        best=best,
        ratio=statistics.median(ours) / statistics.median(fixed[best]),
        held_out=statistics.median(ours) / statistics.median(left_out) if left_out else None,
        paired=paired,
    )


def fixed_splits(seconds: dict[str, list[float]]) -> dict[str, list[float]]:
    """A run's part: its fixed splits' epochs."""
    return {name: times for name, times in seconds.items() if name.startswith("fixed")}


def fastest(splits: dict[str, list[float]]) -> str:
    """The split whose epochs have the shortest median."""
    return min(splits, key=lambda name: statistics.median(splits[name]))


def alone_ratios(seconds: dict[str, list[float]], column: str) -> dict | None:
    """One run's part two against the fast rank alone, round by round: its best fixed split's
    epochs over alone's, and `column`'s; None without those columns."""
    fixed, alone = fixed_splits(seconds), seconds.get("fast rank alone")
    if alone is None or column not in seconds or not fixed:
        return None
    best = fastest(fixed)
    return dict(best=best, split=paired_ratios(fixed[best], alone), ours=paired_ratios(seconds[column], alone))


def pooled_line(ratios: list[float], what: str) -> str:
    """`what` over every pooled round: how many were slower, the paired median and its interval."""
    (low, high), slower = bootstrap_interval(ratios), sum(x > 1 for x in ratios)
    median = statistics.median(ratios)
    interval = f"(95% bootstrap interval {low:.3f}-{high:.3f})"
    return f"{what}: slower in {slower} of {len(ratios)} rounds; paired median {median:.3f} {interval}"


def bootstrap_interval(xs: list[float], seed: int = 0) -> tuple[float, float]:
    """A 95% interval of xs's median: the 2.5% and 97.5% points of the medians of RESAMPLES
    resamples of xs (with replacement), seeded so that a rerun prints the same."""
    rng = random.Random(seed)
    medians = [statistics.median(rng.choices(xs, k=len(xs))) for _ in range(RESAMPLES)]
    return quantile(medians, 0.025), quantile(medians, 0.975)


def report(runs: list[tuple[str, dict]], column: str) -> str:
    lines = []
    names = ["run", "best split", "ratio", "split chosen on the other rounds", "paired median", "rounds"]
    for part in PARTS:
        rows = [
            (path, run_ratios(run[part]["seconds"], column)) for path, run in runs if "seconds" in run.get(part, {})
        ]
        rows = [(path, r) for path, r in rows if r is not None]
        if not rows:
            continue
        lines += [f"## {part}: {column} over the run's best fixed split", "", *md_head(names, "llrrrr")]
        for path, r in rows:
            ratios = (r["ratio"], r["held_out"], statistics.median(r["paired"]))
            lines.append(md_row(path, r["best"], *(fmt(x, "{:.3f}") for x in ratios), len(r["paired"])))
        lines += ["", pooled_line([x for _, r in rows for x in r["paired"]], "pooled"), ""]
    twos = [(path, run["two"]["seconds"]) for path, run in runs if "seconds" in run.get("two", {})]
    alone = [(path, r) for path, r in ((path, alone_ratios(seconds, column)) for path, seconds in twos) if r]
    if alone:
        names = ["run", "best split", "the split over alone", f"{column} over alone", "rounds"]
        lines += ["## two: against the fast rank alone (paired medians)", "", *md_head(names, "llrrr")]
        for path, r in alone:
            medians = (fmt(statistics.median(r[key]), "{:.3f}") for key in ("split", "ours"))
            lines.append(md_row(path, r["best"], *medians, len(r["ours"])))
        lines += ["", pooled_line([x for _, r in alone for x in r["split"]], "each run's best split, pooled")]
        lines += [pooled_line([x for _, r in alone for x in r["ours"]], f"{column}, pooled"), ""]
    equal = [(path, equal_ratios(run)[column]) for path, run in runs if column in equal_ratios(run)]
    if equal:
        lines += [
            "## equal: the time over equal shares', seed by seed",
            "",
            *md_head(["run", "median", "rounds"], "lrr"),
        ]
        lines += [md_row(path, fmt(statistics.median(ratios), "{:.3f}"), len(ratios)) for path, ratios in equal]
        lines += ["", pooled_line([x for _, ratios in equal for x in ratios], "pooled"), ""]
    return "\n".join(lines)


def equal_ratios(run: dict) -> dict[str, list[float]]:
    """A run's part equal: {configuration: its time over equal shares', seed by seed}, or {}."""
    equal = run.get("equal")
    return equal["time_ratios"] if isinstance(equal, dict) and isinstance(equal.get("time_ratios"), dict) else {}


def main(argv=None) -> int:
    ap = OneLineParser(prog="balance_pool.py", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "results", nargs="+", help="JSON files of bench/balance/balance.py (one per run): FILE or FILE=COLUMN"
    )
    ap.add_argument("--column", default="--balance", help="the configuration to compare (default --balance)")
    args = ap.parse_args(argv)
    runs = []
    for given in args.results:
        path, _, own = given.partition("=")
        try:
            run = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            ap.error(f"{path}: cannot read it as a results file ({e.__class__.__name__})")
        if not isinstance(run, dict) or not any(isinstance(run.get(part), dict) for part in (*PARTS, "equal")):
            ap.error(f"{path}: not a results file of bench/balance/balance.py with part two, four or equal")
        parts = [run[part]["seconds"] for part in PARTS if isinstance(run.get(part), dict) and "seconds" in run[part]]
        parts += [equal_ratios(run)]
        if own and not any(own in seconds for seconds in parts):
            ap.error(f"{path}: no column {own!r} in its parts two, four and equal")
        for seconds in parts if own else ():
            if own in seconds:
                seconds[args.column] = seconds.pop(own)
        runs.append((path, run))
    text = report(runs, args.column)
    if not text:
        ap.error(f"no run has {args.column!r} with a fixed split in part two or four, or in part equal")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
