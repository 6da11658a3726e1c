"""Part change of bench/balance/balance.py: how many steps --balance takes to balance a slowdown's start
and its end, and the floor of that measure on this machine.

Rank 1 of 2 is held to a third of a core from step 100 to step 300 of 500. Each round runs --balance,
then the same slowdown with fixed shares that are right from the first step after a change (the
floor: 56:8 for the start, the middle of where --balance settles; 32:32 for the end). What the
floor takes is the machine's own settling and the measure's: its windows of 5 steps must start
after the change. So --balance's steps beyond the floor's are its own.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from balance_job import TRAIN, Job, part_name
from harness import figure, png_of, rotated
from stats import md_row

FLOOR = {"56:8": 0, "32:32": 1}  # a fixed split, and the change (0: the start, 1: the end) it is right after
AT, FRACTION, SUBSET = (100, 300), 1 / 3, 32000  # the slowdown: to a third of a core
HELD = f"rank 1 held to a third of a core from step {AT[0]} to step {AT[1]}"  # FRACTION and AT, in words


def change(reps, folder, against=()):
    """Every round: --balance, then each FLOOR split (and --balance of each Revision in `against`),
    in turns; the shares and the time a step took over steps, and the steps until each change is
    balanced."""
    configs = [("--balance", ["--balance"], TRAIN)] + [(split, ["--balance", split], TRAIN) for split in FLOOR]
    configs[1:1] = [(rev.label, ["--balance"], rev.train) for rev in against]
    runs = {name: [] for name, _, _ in configs}
    for rnd in range(reps):
        for name, flags, train in rotated(configs, rnd):
            run = slowdown(flags, Path(folder) / f"change-{part_name(name.strip('-'))}-{rnd}", train)
            runs[name].append(run)
            print(f"  round {rnd + 1}/{reps}  {name:<10} {[c['steps'] for c in run['changed_at']]}", flush=True)
    result = dict(fraction=FRACTION, at=AT, runs=runs.pop("--balance"))
    result["floor"] = {split: runs.pop(split) for split in FLOOR}
    result["against"] = runs  # {"--balance at REV": [runs]}, or empty
    return result


def slowdown(flags, folder, train=TRAIN):
    """One job of 2 ranks (of `train`, a train.py), rank 1 held to FRACTION of a core from step
    AT[0] to AT[1]."""
    args = ["--epochs", "1", "--train-subset", str(SUBSET), "--test-subset", "500", *flags]
    job = Job([None, None], args, folder, [(AT[0], 1, FRACTION), (AT[1], 1, None)], train=train)
    _, events = job.run()
    reviews = [e for e in events if e["event"] == "shares" and e["rank"] == 0]
    steps = [e["step"] for e in reviews]
    share = [e["shares"][1] for e in reviews]
    pace = [None] + [1000 * (b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(reviews, reviews[1:])]
    run = dict(steps=steps, rank1_share=share, step_ms=pace, changed_at=[])
    for (moment, seen, _, _), until in zip(job.applied, (AT[1], SUBSET // 64)):
        run["changed_at"].append(followed(steps, share, pace, step_at(reviews, moment, seen), until))
    return run


def followed(steps, share, pace, start, until):
    """When a change at step `start` is balanced, measured against the 100 steps before `until`
    (the next change, or the end), where the shares have settled:
    - on step time: the first two reviews in a row after which the steps since the one before
      took at most 10% longer than the settled steps' median (the steps it counts are all after
      the change);
    - on rank 1's share: when it enters the band the settled shares keep (their 10th to 90th
      percentile, at least their median ± max(2, 10%)), and when it comes within max(2, 10%) of
      their median."""
    held = [(s, p) for st, s, p in zip(steps, share, pace) if until - 100 < st <= until]
    settled, settled_ms = statistics.median(s for s, _ in held), statistics.median(p for _, p in held)
    near = max(2, 0.1 * settled)
    deciles = statistics.quantiles([s for s, _ in held], n=10)
    band = (min(deciles[0], settled - near), max(deciles[-1], settled + near))
    after = [(i, st) for i, st in enumerate(steps) if i > 0 and steps[i - 1] >= start]
    paced_at = next(
        (st for i, st in after if i + 1 < len(steps) and max(pace[i], pace[i + 1]) <= 1.1 * settled_ms), None
    )
    band_at = next((st for st, s in zip(steps, share) if st > start and band[0] <= s <= band[1]), None)
    near_at = next((st for st, s in zip(steps, share) if st > start and abs(s - settled) <= near), None)
    return dict(
        step=round(start, 1),
        settled_ms=round(settled_ms, 1),
        steps=None if paced_at is None else round(paced_at - start, 1),
        settled=settled,
        band=[round(b, 1) for b in band],
        steps_to_band=None if band_at is None else round(band_at - start, 1),
        steps_to_near=None if near_at is None else round(near_at - start, 1),
    )


def step_at(reviews, moment, seen):
    """The step rank 0 was at when the quota changed at time `moment` (between two reviews' times)."""
    before = [e for e in reviews if e["time"] <= moment]
    after = [e for e in reviews if e["time"] > moment]
    if not before or not after:
        return float(seen)
    a, b = before[-1], after[0]
    return a["step"] + (b["step"] - a["step"]) * (moment - a["time"]) / (b["time"] - a["time"])


def summary(steps):
    """'median (quartiles), k of n within 20' of steps to balance (None: never balanced)."""
    xs = [math.inf if s is None else s for s in steps]
    low, _, high = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else xs * 3

    def text(x):
        return "never" if x == math.inf else f"{x:.0f}"

    within = sum(x <= 20 for x in xs)
    return f"{text(statistics.median(xs))} ({text(low)}-{text(high)}), {within} of {len(xs)} within 20"


def target(result):
    """The issue's target: every change of every --balance run balanced within 20 steps."""
    follows = [c["steps"] for r in result["runs"] for c in r["changed_at"]]
    measured = ", ".join("-" if s is None else f"{s:.0f}" for s in follows)
    ok = all(s is not None and s <= 20 for s in follows)
    return ("change: balanced within 20 steps (slowdown, recovery; step time)", measured, ok)


def report(result):
    """Part change's section of the report (markdown lines)."""
    lines = [
        f"\n## change: {HELD}\n",
        "A change is balanced when two reviews in a row (5 steps apart) end steps that took at most"
        " 10% longer than the median step of the 100 steps before the next change, where the shares"
        " have settled (all of those steps after the change). Rank 1's share enters the band its"
        " settled shares keep (their 10th to 90th percentile, at least their median ± max(2, 10%)),"
        " and comes within max(2, 10%) of their median. The floor: the same slowdown with fixed"
        " shares that are right from the first step after the change.\n",
        md_row("steps to balance", "the start", "the end"),
        md_row("---", "---", "---"),
    ]
    for name, runs in {"--balance": result["runs"], **result.get("against", {})}.items():
        lines.append(md_row(name, *(summary([r["changed_at"][i]["steps"] for r in runs]) for i in (0, 1))))
    for split, i in FLOOR.items():
        cells = ["", ""]
        cells[i] = summary([r["changed_at"][i]["steps"] for r in result["floor"][split]])
        lines.append(md_row(f"the floor: fixed {split}", *cells))
    columns = ("run", "change at step", "settled step ms", "balanced in steps", "settled share (band)")
    lines += ["", md_row(*columns, "steps to the band", "steps to the median"), md_row(*["---"] * 7)]
    for i, run in enumerate(result["runs"]):
        lines += [
            md_row(
                i + 1,
                c["step"],
                c["settled_ms"],
                c["steps"],
                f"{c['settled']} ({c['band'][0]}-{c['band'][1]})",
                c["steps_to_band"],
                c["steps_to_near"],
            )
            for c in run["changed_at"]
        ]
    lines += ["", md_row("the floor: run", "fixed split", "change at step", "settled step ms", "balanced in steps")]
    lines.append(md_row(*["---"] * 5))
    for split, i in FLOOR.items():
        for k, run in enumerate(result["floor"][split]):
            c = run["changed_at"][i]
            lines.append(md_row(k + 1, split, c["step"], c["settled_ms"], c["steps"]))
    return lines


def plot(result):
    """--balance's runs: rank 1's share and the step time over steps (PNG bytes)."""
    fig, axes = figure(2, 1, (8, 6))
    shares, pace = axes[0][0], axes[1][0]
    for i, run in enumerate(result["runs"]):
        shares.plot(run["steps"], run["rank1_share"], marker=".", label=f"run {i + 1}")
        pace.plot(run["steps"][1:], run["step_ms"][1:], marker=".", label=f"run {i + 1}")
    for ax in (shares, pace):
        for step in result["at"]:
            ax.axvline(step, color="grey", linestyle="--")
    shares.set(ylabel="rank 1's images of 64", title=f"--balance: {HELD}")
    pace.set(xlabel="step", ylabel="ms a step (the last 5 steps)")
    shares.legend()
    return png_of(fig)
