"""bench/time_to_accuracy/time_to_accuracy.py's summary: one record per world, the tables (per link rate; with
--repeats, the medians and each run against our best; with @H or several rates, the H x link
table), the free network's time, and the plot."""

from __future__ import annotations

import os
import statistics

from harness import figure, pick, png_of
from stats import fmt, md_head, md_row, median_or_none


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
    """A configuration's name for tables and plots: 'ours' spelt out as its algorithm (ours@H: the
    algorithm alone, since there is no per-step sum to overlap); with --repeats, which run."""
    name = record_or_name if isinstance(record_or_name, str) else record_or_name["config"]
    if name.startswith("ours"):
        name = name.replace("ours", f"ours {ours.split('+')[0] if '@' in name else ours}", 1)
    run = None if isinstance(record_or_name, str) else record_or_name.get("run")
    return f"{name} (run {run})" if run else name


def summarize(raw: dict, spec: dict, n: int, target: float, epochs: int) -> dict:
    """One world's raw result -> the record the tables, plot and JSON show."""
    points, spe = raw["points"], raw["steps_per_epoch"]
    hit = time_to_target(points, target)
    wire = [b for b in raw["wire_bytes"] if b is not None]
    sent = [b for b in raw["sent_bytes"] if b is not None]
    steps, compute_s = raw["steps"], raw["compute_step_s"]
    out = dict(config=spec["name"], kind=spec["kind"], compress=spec["compress"], sync_every=spec.get("sync_every", 1))
    out |= dict(world_size=n, batch_size=raw["batch_size"], steps_per_epoch=spe, steps=steps, points=points)
    out |= pick(raw, "train_seconds wall_seconds")
    out |= dict(ms_per_step=raw["train_seconds"] / steps * 1e3 if steps else None)
    out |= dict(compute_ms_per_step=compute_s * 1e3, compute_x_steps_s=compute_s * steps, target=target)
    out |= dict(reached=hit is not None, time_to_target_s=hit["seconds"] if hit else None)
    out |= dict(steps_to_target=hit["step"] if hit else None, epochs_to_target=hit["epoch"] if hit else None)
    out |= dict(compute_x_steps_to_target_s=compute_s * hit["step"] if hit else None)
    out |= dict(accuracy_by_epoch={str(e): accuracy_after_epoch(points, e, spe) for e in range(1, epochs + 1)})
    out |= dict(final_accuracy=points[-1]["accuracy"] if points else None)
    out |= dict(wire_kb_per_step=statistics.mean(wire) / steps / 1e3 if wire and steps else None)
    out |= dict(sent_kb_per_step=statistics.mean(sent) / steps / 1e3 if sent and steps else None)
    return out | dict(counts_bytes=bool(sent), params_identical=raw["params_identical"])


def table(records: list[dict], ours: str, target: float, epochs: int) -> str:
    """One row per (N, configuration), then per N the free network's: compute only x the steps."""
    acc_cols = sorted({e for e in (1, 2, epochs) if e <= epochs})
    names = ["N", "configuration", f"time to {target:.1%} (s)", "at step (epoch)", "compute only x same steps (s)"]
    names += ["x compute", *(f"acc after {e} ep" for e in acc_cols), "train s (all steps)", "ms/step"]
    lines = md_head([*names, "wire KB/step/rank", "identical"], "rl" + "r" * (len(acc_cols) + 7) + "c")
    for n in sorted({r["world_size"] for r in records}):
        rows = [r for r in records if r["world_size"] == n]
        for r in rows:
            ttt, free_s = r["time_to_target_s"], r["compute_x_steps_to_target_s"]
            at = f"{r['steps_to_target']} ({r['epochs_to_target']:.2f})" if ttt is not None else "-"
            cells = [n, label(r, ours), fmt(ttt, "{:.1f}", "not reached"), at, fmt(free_s, "{:.1f}")]
            cells += [fmt(ttt / free_s if ttt is not None else None, "{:.2f}x")]
            cells += [fmt(r["accuracy_by_epoch"].get(str(e)), "{:.2%}") for e in acc_cols]
            cells += [
                f"{r['train_seconds']:.1f}",
                fmt(r["ms_per_step"], "{:.1f}"),
                fmt(r["wire_kb_per_step"], "{:.0f}"),
            ]
            lines.append(md_row(*cells, "yes" if r["params_identical"] else "**NO**"))
        free = free_network(rows)
        if free:
            cells = [n, f"compute only (free network; {free['of']}'s steps)", fmt(free["to_target_s"], "{:.1f}")]
            cells += ["-", "-", "1.00x", *("-" for _ in acc_cols), f"{free['all_steps_s']:.1f}"]
            lines.append(md_row(*cells, f"{free['ms_per_step']:.1f}", "0", "-"))
    return "\n".join(lines)


def free_network(rows: list[dict]) -> dict | None:
    """What a free network would give for one N: the median compute-only step time over the worlds,
    times the uncompressed per-step run's steps (ours', else DDP's; else any uncompressed one's)."""
    plain = [r for r in rows if r["compress"] == "none"]
    if not rows or not plain:
        return None
    ref = min(plain, key=lambda r: (r.get("sync_every", 1) > 1, r["kind"] != "ours"))
    ms = statistics.median(r["compute_ms_per_step"] for r in rows)
    return {
        "of": ref["config"],
        "ms_per_step": ms,
        "all_steps_s": ms * ref["steps"] / 1e3,
        "to_target_s": ms * ref["steps_to_target"] / 1e3 if ref["steps_to_target"] else None,
    }


def median_time(runs: list[dict]) -> float | None:
    """The median time to target over `runs`; None if any run never reached it."""
    times = [r["time_to_target_s"] for r in runs]
    return statistics.median(times) if None not in times else None


def medians(records: list[dict], ours: str, target: float) -> str:
    """With --repeats, for the records of one link rate: per N and configuration, the median over its
    runs, and each DDP and local SGD configuration against our best, run by run (the runs went
    round-robin, so run r of each saw the same machine); then per N the headline ratios."""
    names = ["N", "configuration", "runs", f"median time to {target:.1%} (s)", "each run (s)", "median ms/step"]
    names += ["median x compute", f"our best's time to {target:.1%} / this one's, run by run"]
    lines, footer = md_head(names, "rlrrlrrl"), []
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
            if best and runs[0]["kind"] in ("ddp", "localsgd"):
                ours_by_run = {r["run"]: r["time_to_target_s"] for r in by_config[best]}
                ratios = [ours_by_run[r["run"]] / r["time_to_target_s"] for r in runs if r["time_to_target_s"]]
                paired = f"{label(best, ours)}: " + ", ".join(f"{x:.3f}x" for x in ratios)
            ratio = [t / r["compute_x_steps_to_target_s"] for t, r in zip(times, runs)] if None not in times else None
            cells = [n, label(config, ours), len(runs), fmt(median_time(runs), "{:.1f}", "not reached")]
            cells += [", ".join(fmt(t, "{:.1f}", "-") for t in times)]
            cells += [fmt(statistics.median(r["ms_per_step"] for r in runs), "{:.1f}")]
            lines.append(md_row(*cells, fmt(ratio and statistics.median(ratio), "{:.2f}x"), paired))
        footer += headline(n, by_config, ours, target)
    return "\n".join(lines + ([""] + footer if footer else []))


def headline(n: int, by_config: dict, ours: str, target: float) -> list[str]:
    """The issue's comparisons for one N and link rate, as ratios of median times to target (above 1:
    ours is faster): the best local SGD against our best ours@H, DDP + PowerSGD against our best."""
    timed = {c: median_time(runs) for c, runs in by_config.items()}
    first = {c: runs[0] for c, runs in by_config.items()}
    mine = [c for c, r in first.items() if r["kind"] == "ours"]
    local = [c for c, r in first.items() if r["kind"] == "localsgd"]
    periodic, psgd = [c for c in mine if first[c].get("sync_every", 1) > 1], [c for c in first if c == "ddp+powersgd"]
    pairs = (("best localsgd@H / best ours@H", local, periodic), ("ddp+powersgd / best ours", psgd, mine))

    def best(configs):
        reached = [c for c in configs if timed[c] is not None]
        return min(reached, key=timed.get) if reached else None

    def named(config, among):
        return f"{label(config, ours)} {timed[config]:.1f} s" if config else f"{', '.join(among)}: not reached"

    rate = next(iter(first.values())).get("rate") or "loopback"
    lines = []
    for what, theirs, ours_side in pairs:
        if theirs and ours_side:
            a, b = best(theirs), best(ours_side)
            ratio = fmt(timed[a] / timed[b] if a and b else None, "{:.2f}x")
            both = f"{named(a, theirs)}; {named(b, ours_side)}"
            lines.append(f"{rate} N={n}: {what}, median time to {target:.1%}: {ratio} ({both})  ")
    return lines


def link_name(rate: str | None) -> str:
    return rate or "loopback"


def h_by_link(records: list[dict], rates: list, ours: str, target: float, epochs: int) -> str:
    """The H x link table: a row per (N, configuration), per link rate the medians over its runs of
    the time and steps to target, the accuracy after epochs 1 and 2 and the wire KB per step and rank
    (the NIC's count: '-' on loopback)."""
    eps = [e for e in (1, 2) if e <= epochs]
    cols = [f"time to {target:.1%} (s)", "steps to it", *(f"acc after {e} ep" for e in eps), "wire KB/step/rank"]
    lines = md_head(
        ["N", "configuration", *(f"{link_name(rate)}: {c}" for rate in rates for c in cols)],
        "rl" + "r" * len(cols) * len(rates),
    )
    for n in sorted({r["world_size"] for r in records}):
        for config in dict.fromkeys(r["config"] for r in records if r["world_size"] == n):
            cells = []
            for rate in rates:
                runs = [r for r in records if (r["world_size"], r["config"], r.get("rate")) == (n, config, rate)]
                t = median_time(runs) if runs else None
                steps = statistics.median(r["steps_to_target"] for r in runs) if t is not None else None
                cells += [fmt(t, "{:.1f}", "not reached" if runs else "-"), fmt(steps, "{:.0f}")]
                cells += [
                    fmt(median_or_none([r["accuracy_by_epoch"].get(str(e)) for r in runs]), "{:.2%}") for e in eps
                ]
                cells += [fmt(median_or_none([r["wire_kb_per_step"] for r in runs]), "{:.0f}")]
            lines.append(md_row(n, label(config, ours), *cells))
    return "\n".join(lines)


def tables(records: list[dict], rates: list, ours: str, target: float, epochs: int, repeats: int) -> str:
    """The markdown's tables: per link rate (a heading each when there are several) the table of every
    run and, with repeats, the medians; then the H x link table when a configuration has @H or there
    are several rates."""
    parts = []
    for rate in rates:
        rows = [r for r in records if r.get("rate") == rate]
        if rows:
            heading = f"#### {link_name(rate)}\n\n" if len(rates) > 1 else ""
            runs = (
                f"\n\nMedians over {repeats} runs, run round-robin:\n\n" + medians(rows, ours, target)
                if repeats > 1
                else ""
            )
            parts.append(heading + table(rows, ours, target, epochs) + runs)
    if records and (len(rates) > 1 or any(r.get("sync_every", 1) > 1 for r in records)):
        parts.append(
            f"H x link (medians over {repeats} run(s) each):\n\n" + h_by_link(records, rates, ours, target, epochs)
        )
    return "\n\n".join(parts)


def markdown(records: list[dict], args, rates: list, host: dict, command: str, notes: str, complete: bool):
    """The results' markdown (a run still going, complete=False, says so), its tables alone and the
    plot's title."""
    link = ", ".join(rates) + " per host" if rates != [None] else "loopback"
    title = (
        f"time to accuracy, {link}; global batch {args.global_batch}, "
        f"{args.epochs} epoch(s)\n1 thread/rank, {host['cpus']} cores; {host['node']}, torch {host['torch']}"
    )
    tbl = tables(records, rates, args.ours, args.target, args.epochs, args.repeats)
    each = ((r, r["load"]["foreign_cpu_cores"]) for r in records)
    loads = (
        f"{link_name(r['rate'])} N={r['world_size']} {r['config']}: other processes {x:.2f} cores" for r, x in each
    )
    load_line = "; ".join(loads)
    partial = "" if complete else f"**PARTIAL: {len(records)} world(s) done when this was written.**  \n"
    md = (
        f"### Time to {args.target:.1%} test accuracy, {link}\n\n{partial}`{command}`  \n{notes}.  \n"
        f"Training seconds only (evaluation excluded; each segment's time is the slowest rank's). "
        f"'x compute' = time to target / (compute-only step time x the same steps).  \nLoad: {load_line}\n\n{tbl}\n"
    )
    return md, tbl, title


def plan_notes(args, specs: list[dict], outer_lr, outer_momentum) -> str:
    """The recipe and settings behind every number (the driver's parsed command line and its
    configurations), for the markdown and the JSON."""
    periodic = sorted({s["sync_every"] for s in specs if s["kind"] == "ours" and s["sync_every"] > 1})
    local = sorted({s["sync_every"] for s in specs if s["kind"] == "localsgd"})
    outer = args.outer + (f" (lr {outer_lr:g}, momentum {outer_momentum:g})" if args.outer == "nesterov" else "")
    per_rank = ", ".join(f"{args.global_batch // n}/rank at N={n}" for n in args.world_sizes)
    test = f" (test: the first {args.test_subset})" if args.test_subset else ""
    between = " (with @H: rank 0 as it stands between syncs)" if periodic or local else ""
    images = f"the first {args.train_subset}" if args.train_subset else "all 60,000"
    notes = f"global batch {args.global_batch} ({per_rank}), {args.epochs} epoch(s) of {images} training images{test}, "
    notes += f"Adam + one-cycle (peak lr {args.lr:g}), seed {args.seed}, 1 thread per rank; ours = utils.sync.buckets "
    notes += f"{args.ours}; PowerSGD rank {args.powersgd_rank}, {args.powersgd_warmup} plain steps first (ours and "
    notes += "DDP's); "
    if periodic:
        notes += f"ours@H (H = {', '.join(map(str, periodic))}): {args.ours.split('+')[0]}, the parameters' change "
        notes += "averaged every H steps behind the next H (utils/sync/periodic.py), outer step "
        notes += f"{outer}, flushed at the end (on the clock); "
    if local:
        notes += f"localsgd@H (H = {', '.join(map(str, local))}): torch's post-local SGD (DDP + post_localSGD_hook, "
        notes += f"PostLocalSGDOptimizer + PeriodicModelAverager), {args.localsgd_warmup} synchronous steps first, "
        notes += "one more average at the end (on the clock); "
    notes += f"evaluated on the {args.test_subset or 10000:,} test images {args.evals_per_epoch}x per epoch, "
    notes += f"clock paused{between}; compute only = {args.compute_steps} steps of all N ranks at once without "
    return notes + f"communication, per world; {os.cpu_count()} CPU cores"


def color_of(r: dict, periods: list[int]):
    """A line's colour: DDP black, torch's local SGD orange, ours blue, ours@H from a colour map by H."""
    import matplotlib

    if r["kind"] == "ddp":
        return "black"
    if r["kind"] == "localsgd":
        return "tab:orange"
    if r.get("sync_every", 1) == 1:
        return "tab:blue"
    return matplotlib.colormaps["viridis"](periods.index(r["sync_every"]) / max(1, len(periods) - 1) * 0.85)


def plot(records: list[dict], title: str, worlds: list[int], ours: str, target: float, rates=(None,)) -> bytes:
    """Test accuracy vs training seconds, a line per configuration, a panel per (link rate, N), as PNG.
    Line style: the compression; marker: o per step, s ours@H, ^ local SGD."""
    style = {"none": "-", "bf16": "--", "fp16": "-.", "powersgd": ":"}
    periods = sorted({r["sync_every"] for r in records if r["kind"] == "ours" and r.get("sync_every", 1) > 1})
    fig, axes = figure(len(rates), len(worlds), (6.6 * len(worlds), 4.8 * len(rates)))
    for row, rate in zip(axes, rates):
        for ax, n in zip(row, worlds):
            rows = [r for r in records if r["world_size"] == n and r.get("rate") == rate]
            for r in rows:
                xs = [p["seconds"] for p in r["points"]]
                ys = [p["accuracy"] * 100 for p in r["points"]]
                color = color_of(r, periods)
                marker = "^" if r["kind"] == "localsgd" else "s" if r.get("sync_every", 1) > 1 else "o"
                line = dict(marker=marker, ms=3, lw=1.6, color=color, label=label(r, ours))
                ax.plot(xs, ys, style.get(r["compress"], "-"), **line)
                if r["time_to_target_s"] is not None:
                    at = [p["step"] for p in r["points"]].index(r["steps_to_target"])
                    reached = r["points"][at]["accuracy"] * 100
                    ax.plot([r["time_to_target_s"]], [reached], marker="*", ms=11, color=color)
            free = free_network(rows)
            if free and free["to_target_s"]:
                free_label = f"compute only x {free['of']}'s steps to {target:.1%}"
                ax.axvline(free["to_target_s"], color="tab:red", lw=1, ls=":", label=free_label)
            ax.axhline(target * 100, color="tab:red", lw=0.8, alpha=0.6)
            top = max((p["accuracy"] * 100 for r in rows for p in r["points"]), default=100)
            low = max(90.0, target * 100 - 3)  # zoomed in on the target, unless the runs never got near
            ax.set_ylim(*((low, min(100.0, top + 0.3)) if top > low + 0.5 else (0, 100)))
            ax.set_xlim(left=0)
            ax.set_xlabel("training wall seconds (evaluation not counted)")
            ax.set_ylabel("test accuracy (%)")
            ax.set_title(f"{link_name(rate)}, N = {n} ranks, batch {rows[0]['batch_size'] if rows else '?'}/rank")
            ax.grid(True, alpha=0.3)
            if rows:  # (a partial run's panels of rates still to come are empty)
                ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return png_of(fig)
