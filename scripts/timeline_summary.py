#!/usr/bin/env python3
"""Where a step's time went, per rank, from a trace written by `train.py --timeline PATH`.

    python scripts/timeline_summary.py runs/timeline.json
    python scripts/timeline_summary.py runs/timeline.json -o timeline.png --plot-steps 3

Per rank: mean step time, and the training thread's time in forward, backward, waiting for
communication (exposed: the thread had nothing else to do) and the optimizer, each without the
spans nested in it (a lazy update's waits and updates happen inside the next forward). Per
bucket: how long its sum ran, and how much of that was hidden under backward, under the next
forward, or exposed (the training thread waited for it).
"""

import argparse
import json
import os
import sys
from collections import defaultdict

PHASES = ("forward", "backward", "exposed comm", "optimizer")
COLOURS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "wait": "#c44e52",
    "sum": "#8172b2",
    "optimizer": "#ccb974",
    "checkpoint": "#937860",
    "evaluate": "#937860",
}


def load(path):
    """(spans by rank: [dict(name, row, start, end, args)], the trace's otherData); times in ms."""
    try:
        with open(path) as f:
            trace = json.load(f)
        events = trace["traceEvents"]
        rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        spans = defaultdict(list)
        for e in events:
            if e.get("ph") == "X":
                spans[e["pid"]].append(
                    dict(
                        name=e["name"],
                        row=rows.get((e["pid"], e["tid"]), str(e["tid"])),
                        start=e["ts"] / 1e3,
                        end=(e["ts"] + e["dur"]) / 1e3,
                        args=e.get("args", {}),
                    )
                )
        return dict(spans), trace.get("otherData", {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        print(f"timeline_summary.py: cannot read a trace from {path}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def overlap(a, b):
    return max(0.0, min(a["end"], b["end"]) - max(a["start"], b["start"]))


def exclusive(span, inner):
    """span's time without the training-row spans nested in it."""
    return (
        span["end"]
        - span["start"]
        - sum(
            overlap(span, s)
            for s in inner
            if s is not span
            and span["start"] <= s["start"]
            and s["end"] <= span["end"]
            and s["name"] not in ("step", "all-reduce")
        )
    )


def summarize(spans):
    """{rank: dict(steps, step_ms, phases {phase: ms per step}, buckets {bucket: dict(...)})}."""
    out = {}
    for rank, mine in sorted(spans.items()):
        training = [s for s in mine if s["row"] == "training"]
        steps = [s for s in training if s["name"] == "step"]
        n = max(1, len(steps))
        top = [s for s in training if s["name"] not in ("step", "all-reduce")]
        phases = dict.fromkeys(PHASES, 0.0)
        for s in top:
            phase = {"wait": "exposed comm", "sum": "exposed comm"}.get(s["name"], s["name"])
            if phase in phases:
                phases[phase] += exclusive(s, top) / n
        buckets = {}
        for s in mine:
            if s["name"] != "sum":
                continue
            b = buckets.setdefault(
                s["args"].get("bucket", 0), dict(count=0, ms=0.0, backward=0.0, forward=0.0, exposed=0.0)
            )
            b["count"] += 1
            b["ms"] += s["end"] - s["start"]
            if s["row"] == "training":  # summed by the training thread itself: all of it exposed
                b["exposed"] += s["end"] - s["start"]
                continue
            waits = [w for w in training if w["name"] == "wait"]  # the training thread idle
            for t in training:
                if t["name"] in ("backward", "forward"):  # less any wait nested in it (lazy update)
                    b[t["name"]] += overlap(s, t) - sum(overlap(s, w) for w in waits if overlap(t, w))
            b["exposed"] += sum(overlap(s, w) for w in waits)
        out[rank] = dict(
            steps=len(steps), step_ms=sum(s["end"] - s["start"] for s in steps) / n, phases=phases, buckets=buckets
        )
    return out


def report(summary, meta):
    lines = [
        f"{meta.get('window', 'a timeline')}; clock error up to {max(meta.get('clock_error_ns', [0])) / 1e3:.0f} us"
    ]
    lines.append(f"{'rank':>4} {'steps':>5} {'step ms':>8} " + " ".join(f"{p:>13}" for p in PHASES))
    for rank, r in summary.items():
        lines.append(
            f"{rank:>4} {r['steps']:>5} {r['step_ms']:>8.2f} "
            + " ".join(
                f"{r['phases'][p]:>7.2f} {r['phases'][p] / r['step_ms'] if r['step_ms'] else 0:>4.0%}" for p in PHASES
            )
        )
    lines.append("bucket sums (ms per step; share hidden under backward / under the next forward / exposed):")
    for rank, r in summary.items():
        for bucket, b in sorted(r["buckets"].items()):
            ms = b["ms"] or 1e-9
            lines.append(
                f"  rank {rank} bucket {bucket}: {b['ms'] / max(1, r['steps']):6.2f} ms, "
                f"{b['backward'] / ms:4.0%} under backward, {b['forward'] / ms:4.0%} under forward, "
                f"{b['exposed'] / ms:4.0%} exposed"
            )
    return "\n".join(lines)


def plot(spans, meta, path, steps):
    """The first `steps` recorded steps of every rank, one band of rows per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = meta.get("first_step", 1)
    keep = lambda s: first <= (s["args"].get("step") or 0) < first + steps  # noqa: E731
    chosen = {rank: [s for s in mine if keep(s)] for rank, mine in spans.items()}
    t0 = min((s["start"] for mine in chosen.values() for s in mine), default=0.0)
    labels, y = [], 0
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.45 * sum(len({s["row"] for s in m}) for m in chosen.values())))
    for rank, mine in sorted(chosen.items()):
        for row in sorted({s["row"] for s in mine}, key=lambda r: (r != "training", r)):
            for s in mine:
                if s["row"] == row and s["name"] in COLOURS:
                    ax.broken_barh([(s["start"] - t0, s["end"] - s["start"])], (y - 0.4, 0.8), color=COLOURS[s["name"]])
            labels.append(f"rank {rank} {row}")
            y += 1
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms (rank 0's clock)")
    ax.set_title(f"{steps} steps from step {first}")
    shown = ["forward", "backward", "wait", "sum", "optimizer", "checkpoint"]
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[name]) for name in shown]
    fig.legend(handles, shown, loc="lower center", ncol=len(shown), frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="the file train.py --timeline wrote")
    p.add_argument(  # -o, as scripts/plot_metrics.py spells it; --plot, the older spelling
        "-o", "--output", "--plot", dest="plot", metavar="PNG", help="also draw the first steps to this PNG"
    )
    p.add_argument("--plot-steps", type=int, default=3, help="steps to draw (default 3)")
    args = p.parse_args(argv)
    spans, meta = load(args.trace)
    if not spans:
        print(f"timeline_summary.py: {args.trace} holds no steps ({meta.get('window', 'no window')})", file=sys.stderr)
        return 2
    print(report(summarize(spans), meta))
    if args.plot:
        plot(spans, meta, args.plot, args.plot_steps)
        print(
            f"drew steps {meta.get('first_step', 1)}-{meta.get('first_step', 1) + args.plot_steps - 1} to {args.plot}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
