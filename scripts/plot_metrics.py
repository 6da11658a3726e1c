#!/usr/bin/env python3
"""Learning curves from the trainer's metrics log(s).

    python3 scripts/plot_metrics.py runs/metrics.jsonl [more.jsonl ...] -o curves.png

train.py (rank 0) appends one JSON line per epoch to runs/metrics.jsonl:
    {"epoch": 1, "train_loss": 0.15, "test_accuracy": 0.9909, "seconds": 34.5,
     "comm_share": 0.24, "world_size": 2, "allreduce": "two-pass", "busbw_gbps": 0.11, "overlap": true}
epoch, train_loss and test_accuracy are required; the others are optional. Newer lines also
hold "losses": [[global step, mean loss since the report before], ...] (every progress report,
ten an epoch) and "test_images": the number of test images the accuracy was measured on.

The PNG has test accuracy and train loss against epoch (one line per run; the loss at every
progress report where the log has it, the epoch's mean as dots), and below them the seconds per
epoch and, when the log has it, the achieved bus bandwidth of the gradient sums (busbw_gbps,
GB/s; otherwise the share of step time spent communicating). The accuracy's title names the
number of test images when every run says the same.

One file can hold several runs, as train.py appends: a line with epoch 1, an epoch lower than
the one before, or another world size / algorithm / overlap setting starts a new run; the same
epoch again (a resumed run repeating an epoch) replaces the earlier line. Lines are labelled by file name
plus world size, algorithm and overlap (and "run k" when a file holds several).

The PNG is written atomically (temporary file + rename). A missing, unreadable, empty or
malformed file: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from utils.errors import UsageError  # noqa: E402
from utils.store.files import write_file  # noqa: E402

PROG = "plot_metrics.py"
REQUIRED = ("epoch", "train_loss", "test_accuracy")


class BadInput(Exception):
    """Reported as one line on stderr, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise BadInput(f"{message} (see --help)")


def number(value, key, where, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadInput(f"{where}: {key!r} must be a number, got {value!r}")
    return float(value)


def read_runs(path: str) -> list[dict]:
    """The runs in one metrics file: [{"rows": [...], "world_size": .., "allreduce": ..}, ...]."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file") from None
    except IsADirectoryError:
        raise BadInput(f"{path}: is a directory, not a metrics file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: cannot read it ({e.__class__.__name__}: {e})") from None
    runs: list[dict] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(f"{where}: not a JSON line ({e.msg})") from None
        if not isinstance(row, dict):
            raise BadInput(f"{where}: expected a JSON object, got {type(row).__name__}")
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise BadInput(f"{where}: missing {', '.join(missing)} (has {', '.join(sorted(row)) or 'nothing'})")
        epoch = number(row["epoch"], "epoch", where)
        if epoch < 0 or epoch != int(epoch):
            raise BadInput(f"{where}: 'epoch' must be a whole number >= 0, got {row['epoch']!r}")
        clean = {
            "epoch": int(epoch),
            "train_loss": number(row["train_loss"], "train_loss", where, allow_none=True),
            "test_accuracy": number(row["test_accuracy"], "test_accuracy", where, allow_none=True),
        }
        for key in ("seconds", "comm_share", "busbw_gbps", "test_images"):
            clean[key] = number(row[key], key, where, allow_none=True) if key in row else None
        clean["losses"] = reports(row.get("losses"), where)
        ident = (row.get("world_size"), row.get("allreduce"), row.get("overlap"))
        last = runs[-1] if runs else None
        prev = last["rows"][-1]["epoch"] if last else None
        if (
            last is None
            or ident != last["ident"]
            or clean["epoch"] < prev
            or (clean["epoch"] == prev and clean["epoch"] <= 1)
        ):
            runs.append(
                {"ident": ident, "world_size": ident[0], "allreduce": ident[1], "overlap": ident[2], "rows": [clean]}
            )
        elif clean["epoch"] == prev:
            last["rows"][-1] = clean  # a resumed run repeated this epoch: keep the later line
        else:
            last["rows"].append(clean)
    if not runs:
        raise BadInput(f"{path}: empty (no metrics lines)")
    return runs


def reports(value, where):
    """A line's "losses": [[global step, loss], ...] with steps rising, or None (an older line)."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
        raise BadInput(f"{where}: 'losses' must be a list of [step, loss] pairs")
    pairs = [(number(s, "losses", where), number(v, "losses", where, allow_none=True)) for s, v in value]
    if any(b[0] <= a[0] for a, b in zip(pairs, pairs[1:])) or any(s <= 0 for s, _ in pairs):
        raise BadInput(f"{where}: the steps in 'losses' must be positive and rising")
    return pairs


def progress_points(run):
    """The run's loss at every progress report, against the epoch (step / steps per epoch: an
    epoch's last report is at its last step), or [] when its lines have none."""
    points = []
    for r in run["rows"]:
        if r["losses"] and r["epoch"] > 0:
            per_epoch = r["losses"][-1][0] / r["epoch"]
            points += [(s / per_epoch, v) for s, v in r["losses"] if v is not None and math.isfinite(v)]
    return points


def accuracy_title(series):
    sizes = {r["test_images"] for _, run in series for r in run["rows"]}
    if len(sizes) == 1 and None not in sizes:
        return f"test accuracy ({int(sizes.pop()):,} images)"
    return "test accuracy"


def file_labels(paths: list[str]) -> list[str]:
    """Shortest distinguishing names: file names, or parent/name when file names repeat."""
    names = [os.path.basename(p) or p for p in paths]
    if len(set(names)) == len(names):
        return names
    return [os.path.join(os.path.basename(os.path.dirname(os.path.abspath(p))), os.path.basename(p)) for p in paths]


def label(name: str, run: dict, k: int, total: int) -> str:
    parts = []
    if run["world_size"] is not None:
        parts.append(f"N={run['world_size']}")
    if run["allreduce"]:
        parts.append(str(run["allreduce"]))
    if run["overlap"] is not None:
        parts.append("overlap" if run["overlap"] else "no overlap")
    return name + (f" run {k + 1}" if total > 1 else "") + (f" ({', '.join(parts)})" if parts else "")


def plot(series: list[tuple[str, dict]], out: Path, title: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    have_busbw = any(r["busbw_gbps"] is not None for _, run in series for r in run["rows"])
    have_comm = any(r["comm_share"] is not None for _, run in series for r in run["rows"])
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.2))
    (acc_ax, loss_ax), (sec_ax, bw_ax) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    max_epochs = max(len(run["rows"]) for _, run in series)
    marker = "o" if max_epochs <= 40 else None

    def draw(ax, key, run, color, name, scale=1.0):
        pts = [(r["epoch"], r[key] * scale) for r in run["rows"] if r[key] is not None and math.isfinite(r[key])]
        if pts:
            line = dict(marker=marker or "o", ms=4, ls="none") if key == "train_loss" and not name else dict(lw=1.6)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, **{"marker": marker, "ms": 3.5, **line})
            if name:
                ax.lines[-1].set_label(name)
        return bool(pts)

    losses, accs = [], []
    for i, (name, run) in enumerate(series):
        c = colors[i % len(colors)]
        draw(acc_ax, "test_accuracy", run, c, name, 100.0)
        points = progress_points(run)
        if points:
            loss_ax.plot([x for x, _ in points], [v for _, v in points], color=c, lw=1.2, label=name)
            losses += [v for _, v in points]
        draw(loss_ax, "train_loss", run, c, None if points else name)
        draw(sec_ax, "seconds", run, c, name)
        if have_busbw:
            draw(bw_ax, "busbw_gbps", run, c, name)
        elif have_comm:
            draw(bw_ax, "comm_share", run, c, name, 100.0)
        accs += [
            r["test_accuracy"] * 100
            for r in run["rows"]
            if r["test_accuracy"] is not None and math.isfinite(r["test_accuracy"])
        ]
        losses += [
            r["train_loss"] for r in run["rows"] if r["train_loss"] is not None and math.isfinite(r["train_loss"])
        ]

    acc_ax.set_title(accuracy_title(series))
    acc_ax.set_ylabel("accuracy, %")
    if accs and min(accs) > 90:  # zoom into the interesting range, but keep 100 % in view
        acc_ax.set_ylim(max(90.0, min(accs) - 0.2 * (100 - min(accs)) - 0.05), 100.0)
    with_reports = any(progress_points(run) for _, run in series)
    loss_ax.set_title(
        "train loss (every tenth of an epoch; dots: the epoch's mean)"
        if with_reports
        else "train loss (mean over the epoch)"
    )
    loss_ax.set_ylabel("cross-entropy")
    if losses and min(losses) > 0 and max(losses) / min(losses) > 8:
        loss_ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        loss_ax.yaxis.set_major_formatter(plain)
        loss_ax.yaxis.set_minor_formatter(
            FuncFormatter(  # label 2, 3 and 5 x 10^k; the rest crowd
                lambda v, _: f"{v:g}" if v > 0 and f"{v:.0e}"[0] in "235" else ""
            )
        )
    sec_ax.set_title("time per epoch")
    sec_ax.set_ylabel("seconds")
    sec_ax.set_ylim(bottom=0)
    if have_busbw:
        lacking = sum(all(r["busbw_gbps"] is None for r in run["rows"]) for _, run in series)
        bw_ax.set_title(
            "gradient sums: achieved bus bandwidth (busbw)"
            + (f"\n({lacking} run(s) without busbw_gbps not shown)" if lacking else "")
        )
        bw_ax.set_ylabel("GB/s")
        bw_ax.set_ylim(bottom=0)
    elif have_comm:
        bw_ax.set_title("communication share of step time")
        bw_ax.set_ylabel("% of step time")
        bw_ax.set_ylim(0, 100)
    else:
        bw_ax.text(
            0.5,
            0.5,
            "no busbw_gbps / comm_share in these logs",
            ha="center",
            va="center",
            transform=bw_ax.transAxes,
            color="0.5",
        )
        bw_ax.set_yticks([])
    for ax in axes.flat:
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    handles, labels = acc_ax.get_legend_handles_labels()
    if not handles:
        handles, labels = loss_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, max(1, len(labels))), fontsize=9, frameon=False)
    fig.suptitle(title or "MNIST data-parallel training: learning curves", fontsize=12)
    rows = math.ceil(len(labels) / 3) if labels else 0
    fig.tight_layout(rect=(0, 0.035 * rows + 0.01, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    write_file(out, buf.getvalue())


def main(argv=None) -> int:
    ap = Parser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("files", nargs="+", help="metrics JSONL file(s), e.g. runs/metrics.jsonl")
    ap.add_argument("-o", "--output", default="curves.png", help="PNG to write (default curves.png)")
    ap.add_argument("--title", help="figure title")
    try:
        args = ap.parse_args(argv)
        out = Path(args.output)
        if out.is_dir():
            raise BadInput(f"-o {args.output} is a directory; give a file name, e.g. {out / 'curves.png'}")
        names = file_labels(args.files)
        series = []
        for path, name in zip(args.files, names):
            runs = read_runs(path)
            series += [(label(name, run, k, len(runs)), run) for k, run in enumerate(runs)]
        plot(series, out, args.title)
    except (BadInput, UsageError) as e:  # UsageError: write_file could not write the PNG
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{PROG}: error: cannot write {args.output}: {e.strerror or e}", file=sys.stderr)
        return 2
    epochs = sum(len(run["rows"]) for _, run in series)
    print(f"wrote {out} ({len(series)} run(s), {epochs} epoch(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
