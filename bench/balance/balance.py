"""--balance on servers of unequal speed, slowed for real by CPU quotas (scripts/throttle.py).

    python bench/balance/balance.py  # every part, about 30 minutes, as root
    python bench/balance/balance.py --only two --reps 3

Every rank is its own process with 1 thread, over loopback; the configurations of a part take
turns round by round (a slow minute hits them all alike); each figure is a median over rounds.

    two     2 ranks, rank 1 held to half a core, one epoch of --train-subset 12800: equal shares,
            --balance, a sweep of fixed splits (--balance A:B), and the fast rank alone (64 a step)
    four    4 ranks held to 60/40/30/20% of a core (150% in all): equal, --balance, fixed splits
            in proportion to the quotas and around where --balance settles
    change  2 ranks at full speed; rank 1 held to a third of a core from step 100 to step 300 of 500:
            the steps --balance takes to balance each change (shares and step times, plotted),
            and the same with fixed shares right from the change: the measure's floor
            (bench/balance/balance_change.py)
    equal   2 ranks at full speed, 2 epochs of all 60,000 images, seeds 1, 2, 3 (then again):
            --balance against equal shares, time and test accuracy
    room    part two's best split (the first A:B of --splits, or 53:11) against the fast rank alone,
            step by step from timelines: what a split can save, and what it pays
            (bench/balance/balance_room.py)

The targets (issue: servers of unequal speed) are checked at the end: PASS or FAIL per line.

Side by side with other revisions (whole runs drift by more than a change moves them): each
--against adds its --balance (git archive'd into the logs' folder) to every part, and --splits
replaces the sweeps of fixed splits:

    python bench/balance/balance.py --only two --only four --reps 6 --against bf13417 --splits 53:11,37:17:9:1
    python bench/balance/balance.py --only change --reps 8 --against bf13417 --against 56f0379
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections import namedtuple
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # bench/common: harness, stats (run directly)
import balance_change
import balance_room
import harness
from balance_job import TRAIN, Job, part_name
from harness import REPO, RESULTS, bench_parser, command_line, host_info, rotated, throttle, write_results
from stats import md_head, md_row

PARTS = ("two", "four", "change", "equal", "room")
TWO_SPLITS = ("36:28", "40:24", "43:21", "46:18", "48:16", "50:14", "53:11", "56:8")
FOUR = (0.6, 0.4, 0.3, 0.2)
FOUR_SPLITS = ("26:17:13:8", "28:17:12:7", "34:18:10:2", "37:17:9:1", "40:16:7:1")  # by quota, and by --balance


Revision = namedtuple("Revision", "name train label")  # for --against: a revision, its train.py, its name in tables


def export(rev, folder):
    """The tree of git revision `rev` (a commit: see main), streamed into `folder` (a Revision)."""
    with subprocess.Popen(["git", "-C", str(REPO), "archive", rev], stdout=subprocess.PIPE) as git:
        with tarfile.open(fileobj=git.stdout, mode="r|") as archive:
            archive.extractall(folder, filter="data")
    return Revision(rev, str(Path(folder) / "train.py"), f"--balance at {rev}")


def epochs_of(folder):
    """[(epoch, test accuracy %, seconds)] from the metrics rank 0 of a job run in `folder` wrote
    (the epoch line rounds its time to 0.1 s: 3% of part two's epoch)."""
    lines = (Path(folder) / "runs" / "metrics.jsonl").read_text().splitlines()
    return [(m["epoch"], round(100 * m["test_accuracy"], 2), m["seconds"]) for m in map(json.loads, lines)]


def rounds(configs, reps, folder, run_one):
    """Every configuration once per round, in turns; {name: [result per round]}."""
    results = {name: [] for name, _ in configs}
    for rnd in range(reps):
        for name, spec in rotated(configs, rnd):
            result = run_one(spec, Path(folder) / f"{part_name(name)}-{rnd}")
            results[name].append(result)
            print(f"  round {rnd + 1}/{reps}  {name:<22} {result}", flush=True)
    return results


def epoch_seconds(fractions, subset):
    """rounds()' run_one: one epoch's seconds of a configuration: 'equal', 'alone' (rank 0 alone),
    'measured' (--balance), a split A:B..., or a Revision (its --balance)."""
    args = ["--epochs", "1", "--train-subset", str(subset), "--test-subset", "500", "--timeout", "120"]

    def run_one(spec, folder):
        ranks, train = fractions if spec != "alone" else [None], spec.train if isinstance(spec, Revision) else TRAIN
        Job(ranks, args + spec_flags(spec), folder, train=train).run()
        return round(epochs_of(folder)[-1][2], 3)

    return run_one


def spec_flags(spec):
    if isinstance(spec, Revision):
        return ["--balance"]
    return dict(equal=[], alone=[], measured=["--balance"]).get(spec, ["--balance", spec])


def sweep(fractions, splits, reps, folder, subset, alone=False, against=()):
    configs = [("equal shares", "equal"), ("--balance", "measured")] + [(f"fixed {s}", s) for s in splits]
    configs[2:2] = [(rev.label, rev) for rev in against]
    if alone:
        configs.append(("fast rank alone", "alone"))
    times = rounds(configs, reps, folder, epoch_seconds(fractions, subset))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    best = min((n for n in medians if n.startswith("fixed")), key=medians.get)
    return dict(fractions=fractions, subset=subset, seconds=times, median=medians, best_fixed=best)


def equal(reps, folder, seeds=(1, 2, 3), against=()):
    """Seeds 1, 2, 3, 1, 2, ... (`reps` of them), each a round of equal shares and --balance (and
    --balance of each Revision in `against`)."""
    kinds = [("equal", [], TRAIN), ("--balance", ["--balance"], TRAIN)]
    kinds += [(rev.label, ["--balance"], rev.train) for rev in against]
    configs = [
        (f"{name} seed {seeds[i % len(seeds)]} #{i}", (flags, seeds[i % len(seeds)], train))
        for i in range(reps)
        for name, flags, train in rotated(kinds, i)  # (each goes first in turn)
    ]

    def run_one(spec, folder):
        flags, seed, train = spec
        args = ["--epochs", "2", "--seed", str(seed), *flags]
        Job([None, None], args, folder, train=train).run()
        epochs = epochs_of(folder)
        return dict(seed=seed, seconds=round(sum(s for _, _, s in epochs), 3), accuracy=epochs[-1][1])

    results = rounds(configs, 1, folder, run_one)
    by = {name: [r[0] for n, r in results.items() if n.startswith(name + " seed")] for name, _, _ in kinds}
    ratios = {name: [b["seconds"] / a["seconds"] for a, b in zip(by["equal"], by[name])] for name in list(by)[1:]}
    return dict(runs=by, time_ratio=ratios["--balance"], time_ratios=ratios)


def targets(result):
    """[(target, measured, PASS/FAIL)]."""
    rows = []
    if "two" in result:
        m = result["two"]["median"]
        best = m[result["two"]["best_fixed"]]
        rows += [
            (
                "two: --balance ≤ 1.05 × the best fixed split",
                f"{m['--balance'] / best:.2f} ({result['two']['best_fixed']})",
                m["--balance"] <= 1.05 * best,
            ),
            (
                "two: --balance ≤ 0.65 × equal shares",
                f"{m['--balance'] / m['equal shares']:.2f}",
                m["--balance"] <= 0.65 * m["equal shares"],
            ),
            (
                "two: --balance ≤ 0.85 × the fast rank alone",
                f"{m['--balance'] / m['fast rank alone']:.2f} ({m['--balance']:.2f} s vs {m['fast rank alone']:.2f} s; "
                f"the best fixed split {best / m['fast rank alone']:.2f})",
                m["--balance"] <= 0.85 * m["fast rank alone"],
            ),
        ]
    if "four" in result:
        m = result["four"]["median"]
        best = m[result["four"]["best_fixed"]]
        rows.append(
            (
                "four: --balance ≤ 1.10 × the best fixed split",
                f"{m['--balance'] / best:.2f} ({result['four']['best_fixed']})",
                m["--balance"] <= 1.10 * best,
            )
        )
    if "change" in result:
        rows.append(balance_change.target(result["change"]))
    if "equal" in result:
        ratio = statistics.median(result["equal"]["time_ratio"])
        acc = {k: [r["accuracy"] for r in v] for k, v in result["equal"]["runs"].items()}
        rows.append(("equal: --balance within 3% of equal shares (time)", f"{ratio:.3f}", ratio <= 1.03))
        rows.append(
            (
                "equal: accuracy within seed noise",
                f"{acc['--balance']} vs {acc['equal']}",
                abs(statistics.mean(acc["--balance"]) - statistics.mean(acc["equal"])) <= 0.1,
            )
        )
    return [(t, v, "PASS" if ok else "FAIL") for t, v, ok in rows]


def report(result):
    lines = [f"# --balance on servers of unequal speed\n\n    {result['command']}\n", f"Host: {result['host']}\n"]
    for part in ("two", "four"):
        if part in result:
            r = result[part]
            lines += [
                f"\n## {part}: ranks held to {r['fractions']} of a core, one epoch of {r['subset']} images\n",
                *md_head(("configuration", "epoch s (median)", "per round"), "lrl"),
            ]
            lines += [
                md_row(name, f"{r['median'][name]:.2f}", ", ".join(f"{s:.2f}" for s in r["seconds"][name]))
                for name in r["median"]
            ]
    if "change" in result:
        lines += balance_change.report(result["change"])
    if "room" in result:
        lines += balance_room.report(result["room"])
    if "equal" in result:
        lines += [
            "\n## equal: 2 ranks at full speed, 2 epochs\n",
            md_row("", "seconds", "test accuracy %"),
            md_row("---", "---", "---"),
        ]
        for name, runs in result["equal"]["runs"].items():
            lines += [md_row(f"{name} seed {r['seed']}", f"{r['seconds']:.1f}", r["accuracy"]) for r in runs]
        for name, ratios in result["equal"]["time_ratios"].items():
            each = ", ".join(f"{x:.3f}" for x in ratios)
            lines.append(f"\n{name}: {statistics.median(ratios):.3f}× the time of equal shares (median; {each})")
    lines += ["\n## Targets\n", md_row("target", "measured", ""), md_row("---", "---", "---")]
    lines += [md_row(*row) for row in result["targets"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = bench_parser(__doc__)
    ap.add_argument("--only", choices=PARTS, action="append", help="run only this part (repeatable)")
    ap.add_argument("--reps", type=int, default=3, help="rounds per part (default 3)")
    ap.add_argument("--results-dir", default=str(RESULTS / "balance"))
    ap.add_argument("--train-subset", type=int, default=12800, help="images of an epoch in parts two and four")
    ap.add_argument(
        "--against",
        metavar="REV",
        action="append",
        default=[],
        help="also --balance of this git revision, side by side (repeatable)",
    )
    ap.add_argument("--splits", help="fixed splits to try instead of the sweeps, e.g. 53:11,37:17:9:1")
    args = ap.parse_args(argv)
    splits = args.splits.split(",") if args.splits else []
    if not all(re.fullmatch(r"[1-9]\d*:[1-9]\d*(:[1-9]\d*:[1-9]\d*)?", s) for s in splits):
        print(f"balance.py: --splits: expected A:B or A:B:C:D, comma-separated, not {args.splits!r}", file=sys.stderr)
        return 2
    two_splits = tuple(s for s in splits if s.count(":") == 1) or TWO_SPLITS
    four_splits = tuple(s for s in splits if s.count(":") == 3) or FOUR_SPLITS
    try:
        throttle.controller()
    except throttle.ThrottleError as e:
        print(f"balance.py: {e}; it needs root", file=sys.stderr)
        return 2
    for rev in args.against:
        commit = ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"]
        if subprocess.run(commit, capture_output=True).returncode != 0:
            print(f"balance.py: --against: {rev!r} is no commit of {REPO}", file=sys.stderr)
            return 2
    parts, folder = args.only or list(PARTS), Path(tempfile.mkdtemp(prefix="bench-balance-"))
    print(f"logs in {folder}", flush=True)
    against = [export(rev, folder / f"against-{rev}") for rev in args.against]
    result = dict(command=command_line("balance/balance.py"), host=host_info())
    if "two" in parts:
        result["two"] = sweep([None, 0.5], two_splits, args.reps, folder / "two", args.train_subset, True, against)
    if "four" in parts:
        result["four"] = sweep(list(FOUR), four_splits, args.reps, folder / "four", args.train_subset, False, against)
    if "change" in parts:
        result["change"] = balance_change.change(args.reps, folder, against)
    if "equal" in parts:
        result["equal"] = equal(args.reps, folder, against=against)
    if "room" in parts:
        result["room"] = balance_room.room(args.reps, folder, next((s for s in splits if s.count(":") == 1), "53:11"))
    result["targets"] = targets(result)
    os.makedirs(args.results_dir, exist_ok=True)
    stem = Path(args.results_dir) / ("balance" if not args.only else "balance-" + "-".join(args.only))
    png = balance_change.plot(result["change"]) if "change" in result else None
    write_results(stem, result, report(result), png)
    print(report(result))
    return 0 if all(ok == "PASS" for _, _, ok in result["targets"]) else 1


if __name__ == "__main__":
    sys.exit(harness.run_driver(main, None, "balance.py"))  # SIGTERM, SIGHUP: the ranks are killed, the quotas undone
