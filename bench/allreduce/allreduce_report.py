"""bench/allreduce/allreduce.py's summary: the table, the issues' targets (bench/common/targets.py) with PASS/MISS,
the paired comparisons with gloo, the load lines and the plot."""

from __future__ import annotations

import os
import statistics

from harness import figure, pick, png_of
from stats import fmt, md_head, md_row, p_text, quiet, ratios_to_gloo, sign_test_p
from targets import bound

ALGORITHMS = ("gloo", "two-pass", "two-pass-pipelined", "ring", "hierarchical")
MB = 1e6  # bandwidth unit, as in nccl-tests (GB/s = 1e9 B/s)
MIB = 1 << 20

# (name, algorithm, world sizes (hosts), min bytes, metric, bound); the bounds are bench/common/targets.py's
RING, TWO_PASS = (2, 3, 4), f"two-pass-pipelined <= {bound('two_pass_limit'):.1f}x limit, >= 4 MiB"
TARGETS = (
    (f"ring <= {bound('ring_limit'):.2f}x limit, >= 1 MiB", "ring", RING, MIB, "ratio_limit", bound("ring_limit")),
    ("ring no slower than gloo, >= 1 MiB", "ring", RING, MIB, "ratio_gloo", bound("ring_gloo")),
    (TWO_PASS, "two-pass-pipelined", (4,), 4 * MIB, "ratio_limit", bound("two_pass_limit")),
)
# With several ranks per host (--ranks-per-host K > 1; world sizes count hosts): issue #18.
FASTER = "hierarchical >= {:.1f}x faster than {}, >= 1 MiB"
LIMIT = f"hierarchical <= {bound('hierarchical_limit'):.2f}x limit, >= 1 MiB"
HIERARCHICAL_TARGETS = tuple(
    (name, "hierarchical", (2, 3), MIB, metric, bound(key))
    for name, metric, key in (
        (LIMIT, "ratio_limit", "hierarchical_limit"),
        (FASTER.format(1 / bound("hierarchical_gloo"), "gloo"), "ratio_gloo", "hierarchical_gloo"),
        (FASTER.format(1 / bound("hierarchical_ring"), "ring"), "ratio_ring", "hierarchical_ring"),
    )
)


def human(nbytes: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B" if nbytes < 1024 else f"{nbytes / 1024:.1f}K"


def summarize(raw: dict, rate_bytes: float | None) -> list[dict]:
    """Raw per-world results -> one flat record per (N, size, algorithm) with derived columns."""
    records, n = [], raw["world_size"]
    hosts, k = raw.get("hosts", n), raw.get("ranks_per_host", 1)  # the limit counts hosts: their cards
    for size in raw["sizes"]:
        median = {r["algorithm"]: statistics.median(r["times_s"]) for r in size["rows"]}
        limit = 2 * (hosts - 1) / hosts * size["bytes"] / rate_bytes if rate_bytes else None
        for row in size["rows"]:
            t, times, alg = median[row["algorithm"]], row["times_s"], row["algorithm"]
            rec = dict(world_size=n, hosts=hosts, ranks_per_host=k, size=size["label"], bytes=size["bytes"])
            rec.update(numel=size["numel"], algorithm=alg, chunks=row["chunks"], iters=len(times))
            rec.update(warmup=size["warmup"])
            rec.update(times_ms=[x * 1e3 for x in times], median_ms=t * 1e3, min_ms=min(times) * 1e3)
            rec.update(max_ms=max(times) * 1e3, rank_median_ms=[x * 1e3 for x in row["rank_median_s"]])
            rec.update(algbw_MBps=size["bytes"] / t / MB, busbw_MBps=size["bytes"] / t * 2 * (hosts - 1) / hosts / MB)
            rec.update(limit_ms=limit * 1e3 if limit else None, ratio_limit=t / limit if limit else None)
            rec.update(ratio_gloo=t / median["gloo"] if median.get("gloo") else None)
            rec.update(ratio_ring=t / median["ring"] if median.get("ring") and alg != "ring" else None)
            records.append(rec | pick(row, "correct bit_identical max_error_over_bound problems"))
    return records


def table(records: list[dict]) -> str:
    names = "N,size,bytes,algorithm,chunks,iters,time ms,spread,algbw MB/s,busbw MB/s,limit ms,x limit,x gloo,ok"
    lines = md_head(names.split(","), "rlrl" + "r" * 9 + "c")
    for r in records:
        spread = (r["max_ms"] - r["min_ms"]) / r["median_ms"] * 100
        time_ms = fmt(r["median_ms"], "{:.3f}" if r["median_ms"] < 10 else "{:.1f}")
        cells = [world_label(r), r["size"], r["bytes"], r["algorithm"], fmt(r["chunks"], "{}"), r["iters"], time_ms]
        cells += [f"{spread:.0f}%", fmt(r["algbw_MBps"]), fmt(r["busbw_MBps"]), fmt(r["limit_ms"], "{:.2f}")]
        cells += [fmt(r["ratio_limit"], "{:.3f}"), fmt(r["ratio_gloo"], "{:.2f}"), "yes" if r["correct"] else "**NO**"]
        lines.append(md_row(*cells))
    return "\n".join(lines)


def world_label(r: dict) -> str:
    """N for one rank per host, "2×4" (hosts × ranks each) for several."""
    k = r.get("ranks_per_host", 1)
    return str(r["world_size"]) if k == 1 else f"{r['hosts']}×{k}"


def evaluate_targets(records: list[dict], mode: str, ranks_per_host: int = 1) -> list[dict]:
    """Targets per number of hosts (N): TARGETS with one rank per host, HIERARCHICAL_TARGETS with several."""
    out = []
    candidates = sorted({r["algorithm"] for r in records if r["algorithm"].startswith("ring:")})
    ring = [(name, rest) for name, alg, *rest in TARGETS if alg == "ring"]
    targets = [
        *TARGETS,
        *((name.replace("ring", c, 1) + " [candidate]", c, *rest) for c in candidates for name, rest in ring),
    ]
    if ranks_per_host > 1:
        targets = list(HIERARCHICAL_TARGETS)
    for name, alg, worlds, min_bytes, metric, limit in targets:
        for n in worlds:
            rows = [r for r in records if r["algorithm"] == alg and r.get("hosts", r["world_size"]) == n]
            rows = [r for r in rows if r["bytes"] >= min_bytes and r.get(metric) is not None]
            t = {"target": name, "world_size": n, "label": str(n) if ranks_per_host == 1 else f"{n}×{ranks_per_host}"}
            if mode != "cluster" or not rows:
                why = "targets are for --cluster --rate" if mode != "cluster" else "not measured"
                out.append(t | {"status": "N/A", "why": why})
                continue
            worst = max(rows, key=lambda r: r[metric])
            t |= {"bound": limit, "metric": metric, "status": "PASS" if worst[metric] <= limit else "MISS"}
            t |= {"worst_ratio": worst[metric], "worst_size": worst["size"]}
            floors = {r["size"]: round(r["floor_ratio"], 3) for r in rows if "floor_ratio" in r}
            t["wire_floor"] = floors if metric == "ratio_limit" else {}
            t["per_size"] = {r["size"]: round(r[metric], 4) for r in rows}
            reference = {"ratio_gloo": "gloo", "ratio_ring": "ring"}.get(metric)
            out.append(t | {"paired": paired_vs_gloo(records, rows, reference) if reference else {}})
    return out


def paired_vs_gloo(records: list[dict], rows: list[dict], reference: str = "gloo") -> dict:
    """Per size: the median of (time / gloo's time) over repetitions, which ran side by side, in
    how many repetitions it was faster, and the sign test's p. Tells a tie from a real difference.
    reference: another algorithm to pair with instead of gloo."""
    paired = ratios_to_gloo(records, reference)
    out = {}
    for r in rows:
        ratios = paired.get((r["world_size"], r["size"], r["algorithm"]))
        if ratios:
            faster = sum(x < 1 for x in ratios)
            p = round(sign_test_p(faster, len(ratios)), 3)
            out[r["size"]] = [round(statistics.median(ratios), 4), faster, len(ratios), p]
    return out


def target_lines(targets: list[dict]) -> str:
    lines = []
    for t in targets:
        label = t.get("label", t["world_size"])
        if t["status"] == "N/A":
            lines.append(f"N/A   {t['target']:<50} N={label}  ({t['why']})")
            continue
        sizes = "  ".join(f"{k} {v:.3f}" for k, v in t["per_size"].items())
        worst = f"worst {t['worst_ratio']:.3f}x at {t['worst_size']} (bound {t['bound']:.2f})"
        lines.append(f"{t['status']:<5} {t['target']:<50} N={label}  {worst}   [{sizes}]")
        if t.get("wire_floor") and not t["target"].startswith("two-pass"):
            floors = "  ".join(f"{k} {v:.3f}" for k, v in t["wire_floor"].items())
            lines.append(f"{'':<5} {'  wire floor of any all-reduce, same sizes':<50} N={label}  [{floors}]")
        if t.get("paired"):
            paired = "  ".join(
                f"{k} {m:.3f} ({faster}/{total}, {p_text(p)})" for k, (m, faster, total, p) in t["paired"].items()
            )
            lines.append(f"{'':<5} {'  paired per repetition (faster in k/n, p)':<50} N={label}  [{paired}]")
    return "\n".join(lines)


def load_lines(load: dict) -> str:
    lines = []
    for n, v in load.items():
        busy = f"{v['busy_cores']:.2f} of {os.cpu_count()} cores busy, our ranks {v['ours_cores']:.2f}"
        warning = "" if quiet(v) else "  <- NOT QUIET, timings may be inflated"
        lines.append(f"load  N={n}: {busy}, other processes {v['foreign_cpu_cores']:.2f}{warning}")
    return "\n".join(lines)


STYLE = {  # an algorithm's line: colour, marker, line style
    "gloo": ("k", "o", "-"),
    "two-pass": ("tab:red", "s", "--"),
    "two-pass-pipelined": ("tab:orange", "^", "-"),
    "ring": ("tab:blue", "D", "-"),
    "hierarchical": ("tab:green", "P", "-"),
}
EXTRA_COLORS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive")  # candidates (--candidate)


def plot(records: list[dict], title: str, rate_bytes: float | None, burst_bytes: int = 0) -> bytes:
    """Time and busbw against buffer size, an algorithm per line, a column per N; as PNG."""
    worlds = sorted({r["world_size"] for r in records})
    extra = sorted({r["algorithm"] for r in records} - set(ALGORITHMS))
    fig, axes = figure(2, len(worlds), (5.2 * len(worlds), 8.2), sharex=True)
    for col, n in enumerate(worlds):
        first = next(r for r in records if r["world_size"] == n)
        hosts = first.get("hosts", n)  # the limit counts hosts (their cards)
        top, bottom = axes[0][col], axes[1][col]
        for alg in [*ALGORITHMS, *extra]:
            rows = [r for r in records if r["world_size"] == n and r["algorithm"] == alg]
            rows.sort(key=lambda r: r["bytes"])
            if not rows:
                continue
            c, m, ls = STYLE.get(alg) or (EXTRA_COLORS[extra.index(alg) % 4], "v", "-.")
            x = [r["bytes"] for r in rows]
            top.plot(x, [r["median_ms"] for r in rows], color=c, marker=m, ls=ls, ms=4, label=alg)
            top.fill_between(x, [r["min_ms"] for r in rows], [r["max_ms"] for r in rows], color=c, alpha=0.12)
            bottom.plot(x, [r["busbw_MBps"] for r in rows], color=c, marker=m, ls=ls, ms=4, label=alg)
        xs = sorted({r["bytes"] for r in records if r["world_size"] == n})
        if rate_bytes:
            limits = [2 * (hosts - 1) / hosts * s / rate_bytes * 1e3 for s in xs]
            top.plot(xs, limits, color="0.5", ls=":", lw=2, label="bandwidth limit 2(N-1)/N·S/B")
            at_limit = f"busbw at the limit = B = {rate_bytes / MB:g} MB/s"
            bottom.axhline(rate_bytes / MB, color="0.5", ls=":", lw=2, label=at_limit)
            # Small buffers ride on tbf's bucket (sent at veth speed): busbw there says nothing about
            # the rate, so shade them and clip the axis to keep the bandwidth-bound sizes readable.
            fits = [x for x in xs if 2 * (hosts - 1) / hosts * x <= burst_bytes]
            if fits:
                for ax in (top, bottom):
                    ax.axvspan(xs[0] / 1.2, fits[-1] * 1.2, color="0.92", zorder=0)
                bottom.text(fits[0], rate_bytes / MB * 1.55, "fits in the tbf burst", fontsize=8, va="top", color="0.4")
            bottom.set_ylim(0, rate_bytes / MB * 1.6)
        model = next((r for r in records if r["size"] == "model" and r["world_size"] == n), None)
        if model:
            for ax in (top, bottom):
                ax.axvline(model["bytes"], color="tab:green", lw=0.8, alpha=0.6)
            where = dict(xycoords=("data", "axes fraction"), rotation=90, ha="right", va="bottom")
            top.annotate("model", (model["bytes"], 0.02), color="tab:green", fontsize=8, **where)
        top.set_xscale("log", base=2)
        top.set_yscale("log")
        top.set_title(f"N = {n} ranks" if hosts == n else f"{hosts} hosts × {n // hosts} ranks")
        top.set_ylabel("time per all-reduce, ms (median; band = min..max)")
        bottom.set_ylabel("busbw, MB/s  (= S/t * 2(N-1)/N)")
        bottom.set_xlabel("buffer size")
        if not rate_bytes:
            bottom.set_ylim(bottom=0)
        ticks = [s for s in xs if s & (s - 1) == 0]
        bottom.set_xticks(ticks)
        bottom.set_xticklabels([human(s) for s in ticks])
        for ax in (top, bottom):
            ax.grid(True, which="major", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for handle, label in zip(*axes[1][0].get_legend_handles_labels()):
        if label.startswith("busbw at"):  # the one line only the bottom row has
            handles.append(handle)
            labels.append(label)
    fig.suptitle(title, fontsize=11)
    legend = dict(loc="upper center", ncol=len(labels), fontsize=9, frameon=False, bbox_to_anchor=(0.5, 0.965))
    fig.legend(handles, labels, **legend)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return png_of(fig, dpi=110)
