"""bench/time_to_accuracy.py's summary: one record per world, the tables (with --repeats, the
medians and each run against our best), the free network's time, and the plot."""
from __future__ import annotations

import statistics

from harness import fmt, png_of


def time_to_target(points: list[dict], target: float) -> dict | None:
    """The first evaluation point at or above `target` accuracy (points in training order, each with
    "accuracy", "seconds", "step", "epoch"), or None if no point reaches it."""
    for p in points:
        if p["accuracy"] >= target:
            return p
    return None


def accuracy_after_epoch(points: list[dict], epoch: int, steps_per_epoch: int) -> float | None:
    """Test accuracy at the end of `epoch` (1-based), or None if the run did not evaluate there."""
    for p in points:
        if p["step"] == epoch * steps_per_epoch:
            return p["accuracy"]
    return None


def label(record_or_name, ours: str) -> str:
    """A configuration's name for tables and plots: 'ours' spelt out as its algorithm; with --repeats,
    which run."""
    name = record_or_name if isinstance(record_or_name, str) else record_or_name["config"]
    name = name.replace("ours", f"ours {ours}", 1) if name.startswith("ours") else name
    run = None if isinstance(record_or_name, str) else record_or_name.get("run")
    return f"{name} (run {run})" if run else name


def summarize(raw: dict, spec: dict, n: int, target: float, epochs: int) -> dict:
    """One world's raw result -> the record the tables, plot and JSON show."""
    points, spe = raw["points"], raw["steps_per_epoch"]
    hit = time_to_target(points, target)
    wire = [b for b in raw["wire_bytes"] if b is not None]
    sent = [b for b in raw["sent_bytes"] if b is not None]
    steps = raw["steps"]
    return {
        "config": spec["name"], "kind": spec["kind"], "compress": spec["compress"], "world_size": n,
        "batch_size": raw["batch_size"], "steps_per_epoch": spe, "steps": steps, "points": points,
        "train_seconds": raw["train_seconds"], "wall_seconds": raw["wall_seconds"],
        "ms_per_step": raw["train_seconds"] / steps * 1e3 if steps else None,
        "compute_ms_per_step": raw["compute_step_s"] * 1e3,
        "compute_x_steps_s": raw["compute_step_s"] * steps,
        "target": target, "reached": hit is not None,
        "time_to_target_s": hit["seconds"] if hit else None, "steps_to_target": hit["step"] if hit else None,
        "epochs_to_target": hit["epoch"] if hit else None,
        "compute_x_steps_to_target_s": raw["compute_step_s"] * hit["step"] if hit else None,
        "accuracy_by_epoch": {str(e): accuracy_after_epoch(points, e, spe) for e in range(1, epochs + 1)},
        "final_accuracy": points[-1]["accuracy"] if points else None,
        "wire_kb_per_step": statistics.mean(wire) / steps / 1e3 if wire and steps else None,
        "sent_kb_per_step": statistics.mean(sent) / steps / 1e3 if sent and steps else None,
        "counts_bytes": bool(sent), "params_identical": raw["params_identical"],
    }


def table(records: list[dict], ours: str, target: float, epochs: int) -> str:
    """One row per (N, configuration), then per N the free network's: compute only x the steps."""
    acc_cols = [e for e in (1, 2, epochs) if e <= epochs]
    acc_cols = sorted(set(acc_cols))
    head = (f"| N | configuration | time to {target:.1%} (s) | at step (epoch) | compute only x same steps (s) "
            f"| x compute | " + " | ".join(f"acc after {e} ep" for e in acc_cols)
            + " | train s (all steps) | ms/step | wire KB/step/rank | identical |")
    lines = [head, "|--:|:--|--:|--:|--:|--:|" + "--:|" * len(acc_cols) + "--:|--:|--:|:-:|"]
    for n in sorted({r["world_size"] for r in records}):
        rows = [r for r in records if r["world_size"] == n]
        for r in rows:
            ttt = r["time_to_target_s"]
            lines.append("| " + " | ".join([
                str(n), label(r, ours), fmt(ttt, "{:.1f}", "not reached"),
                f"{r['steps_to_target']} ({r['epochs_to_target']:.2f})" if ttt is not None else "-",
                fmt(r["compute_x_steps_to_target_s"], "{:.1f}"),
                fmt(ttt / r["compute_x_steps_to_target_s"] if ttt is not None else None, "{:.2f}x"),
                *(fmt(r["accuracy_by_epoch"].get(str(e)), "{:.2%}") for e in acc_cols),
                f"{r['train_seconds']:.1f}", fmt(r["ms_per_step"], "{:.1f}"), fmt(r["wire_kb_per_step"], "{:.0f}"),
                "yes" if r["params_identical"] else "**NO**"]) + " |")
        free = free_network(rows)
        if free:
            lines.append("| " + " | ".join([
                str(n), f"compute only (free network; {free['of']}'s steps)", f"{free['to_target_s']:.1f}"
                if free["to_target_s"] is not None else "-", "-", "-", "1.00x", *("-" for _ in acc_cols),
                f"{free['all_steps_s']:.1f}", f"{free['ms_per_step']:.1f}", "0", "-"]) + " |")
    return "\n".join(lines)


def free_network(rows: list[dict]) -> dict | None:
    """What a free network would give for one N: the median compute-only step time over the worlds,
    times the uncompressed run's steps (ours', else DDP's)."""
    plain = [r for r in rows if r["compress"] == "none"]
    if not rows or not plain:
        return None
    ref = min(plain, key=lambda r: r["kind"] != "ours")
    ms = statistics.median(r["compute_ms_per_step"] for r in rows)
    return {"of": ref["config"], "ms_per_step": ms, "all_steps_s": ms * ref["steps"] / 1e3,
            "to_target_s": ms * ref["steps_to_target"] / 1e3 if ref["steps_to_target"] else None}


def median_time(runs: list[dict]) -> float | None:
    """The median time to target over `runs`; None if any run never reached it."""
    times = [r["time_to_target_s"] for r in runs]
    return statistics.median(times) if None not in times else None


def medians(records: list[dict], ours: str, target: float) -> str:
    """With --repeats: per N and configuration, the median over its runs, and each DDP configuration
    against our best, run by run (the runs went round-robin, so run r of each saw the same machine)."""
    head = (f"| N | configuration | runs | median time to {target:.1%} (s) | each run (s) | median ms/step "
            f"| median x compute | our best's time to {target:.1%} / this one's, run by run |")
    lines = [head, "|--:|:--|--:|--:|:--|--:|--:|:--|"]
    for n in sorted({r["world_size"] for r in records}):
        by_config = {}
        for r in records:
            if r["world_size"] == n:
                by_config.setdefault(r["config"], []).append(r)
        ours_timed = {c: median_time(runs) for c, runs in by_config.items() if runs[0]["kind"] == "ours"}
        ours_timed = {c: t for c, t in ours_timed.items() if t is not None}
        best = min(ours_timed, key=ours_timed.get) if ours_timed else None
        for config, runs in by_config.items():
            times = [r["time_to_target_s"] for r in runs]
            paired = ""
            if best and runs[0]["kind"] == "ddp":
                ours_by_run = {r["run"]: r["time_to_target_s"] for r in by_config[best]}
                ratios = [ours_by_run[r["run"]] / r["time_to_target_s"] for r in runs if r["time_to_target_s"]]
                paired = f"{label(best, ours)}: " + ", ".join(f"{x:.3f}x" for x in ratios)
            lines.append("| " + " | ".join([
                str(n), label(config, ours), str(len(runs)), fmt(median_time(runs), "{:.1f}", "not reached"),
                ", ".join(fmt(t, "{:.1f}", "-") for t in times),
                fmt(statistics.median(r["ms_per_step"] for r in runs), "{:.1f}"),
                fmt(statistics.median(t / r["compute_x_steps_to_target_s"] for t, r in zip(times, runs))
                    if None not in times else None, "{:.2f}x"), paired]) + " |")
    return "\n".join(lines)


def plot(records: list[dict], title: str, worlds: list[int], ours: str, target: float) -> bytes:
    """Test accuracy vs training seconds, a line per configuration, a panel per N, as PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = {"none": "-", "bf16": "--", "fp16": "-.", "powersgd": ":"}
    fig, axes = plt.subplots(1, len(worlds), figsize=(6.6 * len(worlds), 4.8), squeeze=False)
    for ax, n in zip(axes[0], worlds):
        rows = [r for r in records if r["world_size"] == n]
        for r in rows:
            xs = [p["seconds"] for p in r["points"]]
            ys = [p["accuracy"] * 100 for p in r["points"]]
            ax.plot(xs, ys, style.get(r["compress"], "-"), marker="o", ms=3, lw=1.6,
                    color="tab:blue" if r["kind"] == "ours" else "black", label=label(r, ours))
            if r["time_to_target_s"] is not None:
                ax.plot([r["time_to_target_s"]], [r["points"][[p["step"] for p in r["points"]].index(
                    r["steps_to_target"])]["accuracy"] * 100], marker="*", ms=11,
                    color="tab:blue" if r["kind"] == "ours" else "black")
        free = free_network(rows)
        if free and free["to_target_s"]:
            ax.axvline(free["to_target_s"], color="tab:red", lw=1, ls=":",
                       label=f"compute only x {free['of']}'s steps to {target:.1%}")
        ax.axhline(target * 100, color="tab:red", lw=0.8, alpha=0.6)
        top = max((p["accuracy"] * 100 for r in rows for p in r["points"]), default=100)
        low = max(90.0, target * 100 - 3)            # zoomed in on the target, unless the runs never got near
        ax.set_ylim(*((low, min(100.0, top + 0.3)) if top > low + 0.5 else (0, 100)))
        ax.set_xlim(left=0)
        ax.set_xlabel("training wall seconds (evaluation not counted)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"N = {n} ranks, batch {rows[0]['batch_size'] if rows else '?'}/rank")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return png_of(fig)


