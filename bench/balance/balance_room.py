"""Part room of bench/balance/balance.py: how much a split of part two's step can save on the fast rank
alone, and where it goes, from timelines of rank 0's steps (train.py --timeline).

    alone                      rank 0 alone, 64 images a step (part two's fast rank alone)
    alone at A                 rank 0 alone, A images a step: its share of the split A:B with the
                               machine to itself, so the most that split can save
    split A:B                  2 ranks, rank 1 held to half a core (part two)
    split A:B, rank 1 free     the same without the quota

A split saves rank 0 the images it gives away, and pays for it: two processes share the machine
(rank 0 computes its share slower than alone at A), and rank 0 waits for the sum, whose last
bucket is ready only at the end of backward and goes through rank 1.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import timeline_summary
from balance_job import Job, part_name
from harness import rotated
from stats import md_head, md_row

STEPS, SUBSET = "60:160", 12800  # the steps recorded, of one epoch of SUBSET images at 64 a step
COLUMNS = ("step", "forward and backward", "exposed comm", "optimizer", "the rest")


def room(reps, folder, split="53:11"):
    """Every round each configuration in turn: rank 0's ms a step, in all and by part."""
    share = split.split(":")[0]
    configs = [
        ("alone", [None], []),
        (f"alone at {share}", [None], ["--batch-size", share]),
        (f"split {split}", [None, 0.5], ["--balance", split]),
        (f"split {split}, rank 1 free", [None, None], ["--balance", split]),
    ]
    rounds = {name: [] for name, _, _ in configs}
    args = ["--epochs", "1", "--train-subset", str(SUBSET), "--test-subset", "500"]
    args += ["--timeline", "timeline.json", "--timeline-steps", STEPS]
    for rnd in range(reps):
        for name, fractions, flags in rotated(configs, rnd):
            run = Path(folder) / "room" / f"{part_name(name)}-{rnd}"
            Job(fractions, args + flags, run).run()
            spans, _ = timeline_summary.load(run / "timeline.json")
            rank0 = timeline_summary.summarize(spans)[0]
            phases = rank0["phases"]
            parts = (phases["forward"] + phases["backward"], phases["exposed comm"], phases["optimizer"])
            ms = (rank0["step_ms"], *parts, rank0["step_ms"] - sum(parts))
            rounds[name].append(dict(zip(COLUMNS, ms)))
            print(f"  round {rnd + 1}/{reps}  {name:<26} " + "  ".join(f"{x:6.2f}" for x in ms), flush=True)
    medians = {name: {c: statistics.median(r[c] for r in rs) for c in COLUMNS} for name, rs in rounds.items()}
    return dict(split=split, share=share, rounds=rounds, median=medians)


def report(result):
    """Markdown: the medians, and what the split saved and paid, against the fast rank alone."""
    m, split = result["median"], result["split"]
    alone, ideal, paired = m["alone"], m[f"alone at {result['share']}"], m[f"split {split}"]
    lines = [
        f"\n## room: rank 0's ms a step, steps {STEPS} (medians of {len(result['rounds']['alone'])} rounds)\n",
        *md_head(("configuration", *COLUMNS), "lrrrrr"),
        *(md_row(name, *(f"{row[c]:.2f}" for c in COLUMNS)) for name, row in m.items()),
        "",
        f"- room: alone at its share, rank 0 takes {ideal['step'] / alone['step']:.2f}× the fast rank alone's step",
        f"- paid: rank 0's forward and backward {paired[COLUMNS[1]] / ideal[COLUMNS[1]]:.2f}× theirs alone at its"
        f" share, {paired['exposed comm']:.2f} ms waiting for the sum ({ideal['exposed comm']:.2f} alone), the rest"
        f" of a step {paired['the rest']:.2f} ms ({ideal['the rest']:.2f} alone)",
        f"- the split's step: {paired['step'] / alone['step']:.2f}× the fast rank alone's",
    ]
    return lines
