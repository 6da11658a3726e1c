"""bench/train_step/train_step.py's summary: one record per configuration, the table, the issues' targets
(bench/common/targets.py) with PASS/MISS, and the plot."""

from __future__ import annotations

import statistics

from harness import figure, png_of
from stats import compare, fmt, md_head, md_row, median_or_none, p_text, paired_ratios, quantile
from targets import bound


def summarize(raw: dict, rate: str | None, rate_bits: int | None, batch: int) -> list[dict]:
    """Raw per-world results -> one record per configuration, with derived columns."""
    n, recs = raw["world_size"], []
    for c in raw["configs"]:
        ms = [x * 1e3 for x in c["step_s"]]
        med = statistics.median(ms)
        r = dict(rate=rate, rate_bits_per_s=rate_bits, world_size=n, config=c["name"], kind=c["kind"])
        r |= dict(allreduce=c.get("allreduce"), overlap=c.get("overlap", False), lazy=c.get("lazy", False))
        r |= dict(chunks=c.get("chunks"), bucket_mb=c.get("bucket_mb"), iters=len(ms), step_ms=ms, median_ms=med)
        r |= dict(p25_ms=quantile(ms, 0.25), p75_ms=quantile(ms, 0.75), min_ms=min(ms), max_ms=max(ms))
        for key, part in (("fwd_bwd", "fb"), ("sum_wait", "sum"), ("opt", "opt"), ("cpu", "cpu"), ("cpu_sys", "sys")):
            r[f"{key}_ms"] = statistics.median(x * 1e3 for x in c[f"{part}_s"])
        r["rank_median_ms"] = [x * 1e3 for x in c["rank_median_s"]]
        r["images_per_s_per_rank"] = batch / (med / 1e3)
        r["images_per_s_total"] = batch / (med / 1e3) * (1 if c.get("alone") else n)
        r["params_identical"] = c["params_identical"] if c["kind"] not in ("compute", "wire", "sync") else None
        r |= dict(same_bits_as_plain=c.get("same_bits_as_plain"), batch_size=batch)
        r |= dict(compress=c.get("compress") or c.get("hook"), hook=c.get("hook"))
        r["wire_kb_per_step"] = median_or_none(c.get("tx_bytes"), 1e-3)
        r["sent_kb_per_step"] = median_or_none(c.get("sent_bytes"), 1e-3)
        recs.append(r)
    base = {r["config"]: r["median_ms"] for r in recs}
    for r in recs:
        for key, ref in (("x_compute", "compute"), ("x_compute_alone", "compute-alone"), ("x_ddp", "ddp")):
            r[key] = r["median_ms"] / base[ref] if ref in base else None
    return recs


def table(records: list[dict], mode: str) -> str:
    names = "rate,N,batch,configuration,chunks,bucket MB,ms/step,p25-p75,fwd+bwd,sum/wait,opt,cpu/rank (sys)"
    names += ",img/s/rank,x compute,x DDP,wire KB/step,identical"
    lines = md_head(names.split(","), "lrrl" + "r" * 12 + "c")
    for r in records:
        identical = {None: "-", True: "yes", False: "**NO**"}[r["params_identical"]]
        identical += ", = plain" if r["same_bits_as_plain"] else ""
        cells = [r["rate"] or mode, r["world_size"], r["batch_size"], r["config"], fmt(r["chunks"], "{}")]
        cells += [fmt(r["bucket_mb"], "{:g}"), f"{r['median_ms']:.1f}", f"{r['p25_ms']:.1f}-{r['p75_ms']:.1f}"]
        cells += [f"{r[key]:.1f}" for key in ("fwd_bwd_ms", "sum_wait_ms", "opt_ms")]
        cells += [f"{r['cpu_ms']:.1f} ({r['cpu_sys_ms']:.1f})", f"{r['images_per_s_per_rank']:.0f}"]
        cells += [fmt(r["x_compute"]), fmt(r["x_ddp"]), fmt(r.get("wire_kb_per_step"), "{:.0f}"), identical]
        lines.append(md_row(*cells))
    return "\n".join(lines)


def evaluate_targets(records: list[dict], mode: str, rates: list[str | None], worlds: list[int]) -> list[dict]:
    """The issues' targets (bench/common/targets.py). Ours against DDP and compute only are defined on the
    capped cluster; loopback reports them as info."""
    out = []
    for rate in rates:
        for n in worlds:
            rows = [r for r in records if r["rate"] == rate and r["world_size"] == n]
            by = {r["config"]: r for r in rows}
            out += compression_targets(rows)
            ours = [r for r in rows if r["kind"] == "sum" and not r.get("compress")]
            if not ours or "ddp" not in by:
                continue
            best = fastest(ours)
            out.append(versus("best >= DDP throughput", best, by["ddp"], bound("ddp")))
            if n == 2 and rows[0]["rate_bits_per_s"] == 10**9 and "compute" in by:
                compute, alone = by["compute"], by.get("compute-alone")
                target = versus(f"1gbit N=2: best <= {bound('compute'):.2f}x compute", best, compute, bound("compute"))
                target["ratio_compute_alone"] = best["median_ms"] / alone["median_ms"] if alone else None
                for key in ("sync", "wire"):  # the floors, for comparison
                    if f"compute+{key}" in by:
                        target.update(floor(key, by[f"compute+{key}"], compute))
                out.append(target)
    if mode != "cluster":
        for t in out:
            t["status"] = "info"
    return out + timeline_targets(records)


def versus(target: str, ours: dict, peer: dict, limit: float) -> dict:
    """A target's record: ours' ms/step against peer's, round by round (stats.compare)."""
    out = {"target": target, "rate": ours["rate"], "world_size": ours["world_size"], "best": ours["config"]}
    out |= {"best_ms": ours["median_ms"], "peer": peer["config"], "peer_ms": peer["median_ms"]}
    return out | compare(ours["step_ms"], peer["step_ms"], limit)


def floor(key: str, row: dict, compute: dict) -> dict:
    """A floor (compute+sync, compute+wire) against compute only, shown under a target."""
    paired = statistics.median(paired_ratios(row["step_ms"], compute["step_ms"]))
    return {
        f"{key}_ms": row["median_ms"],
        f"{key}_ratio": row["median_ms"] / compute["median_ms"],
        f"{key}_paired": paired,
    }


def fastest(rows: list[dict]) -> dict | None:
    return min(rows, key=lambda r: r["median_ms"]) if rows else None


def timeline_targets(records: list[dict]) -> list[dict]:
    """Issue #15: recording a timeline costs at most 2% of step time (any link, loopback too)."""
    out, by = [], {(r["rate"], r["world_size"], r["config"]): r for r in records}
    for traced in (r for r in records if r["config"].endswith("+timeline")):
        plain = by.get((traced["rate"], traced["world_size"], traced["config"].removesuffix("+timeline")))
        if plain is not None:
            out.append(versus(f"timeline on <= {bound('timeline'):.2f}x off", traced, plain, bound("timeline")))
    return out


def compression_targets(rows: list[dict]) -> list[dict]:
    """Issue #13's targets for one (rate, N), at 200 Mbit/s only: ours powersgd <= 1.02x DDP + PowerSGD
    (same rank and warm-up), and at N=2 <= 1.30x compute-only; ours bf16 <= 1.02x the better of DDP +
    fp16/bf16 hook. Ours = the fastest of our rows with that compression."""
    if not rows or rows[0]["rate_bits_per_s"] != 200 * 10**6:
        return []
    n, out = rows[0]["world_size"], []
    by = {r["config"]: r for r in rows}
    peer, compute = bound("peer"), bound("powersgd_compute")
    ours_psgd = fastest([r for r in rows if r["kind"] == "sum" and r.get("compress") == "powersgd"])
    if ours_psgd and "ddp+powersgd" in by:
        out.append(versus(f"powersgd <= {peer:.2f}x DDP+PowerSGD", ours_psgd, by["ddp+powersgd"], peer))
    if ours_psgd and n == 2 and "compute" in by:
        t = versus(f"powersgd N=2 <= {compute:.2f}x compute", ours_psgd, by["compute"], compute)
        if "compute+sync" in by:  # the lockstep floor, for comparison
            t.update(floor("sync", by["compute+sync"], by["compute"]))
        out.append(t)
    ours_bf16 = fastest([r for r in rows if r["kind"] == "sum" and r.get("compress") == "bf16"])
    hook = fastest([by[k] for k in ("ddp+fp16", "ddp+bf16") if k in by])
    if ours_bf16 and hook:
        out.append(versus(f"bf16 <= {peer:.2f}x DDP+fp16/bf16 hook", ours_bf16, hook, peer))
    return out


def target_lines(targets: list[dict]) -> str:
    lines = []
    for t in targets:
        status, where = f"{t['status']:<5}", f"{t['rate'] or 'loopback'} N={t['world_size']}"
        paired = f"paired per round: median {t['paired_median_ratio']:.3f}x"
        sign = f"faster in {t['rounds_faster']}/{t['rounds']} rounds, sign test {p_text(t['sign_test_p'])}"
        best = f"{t['best']} {t['best_ms']:.1f} ms vs"
        peer = f"{t['peer_ms']:.1f} ms = {t['ratio']:.3f}x (bound {t['bound']:.2f}x; {paired}"
        if t["target"] == "best >= DDP throughput":
            lines.append(f"{status} best config matches/beats DDP  {where:<14} best {best} ddp {peer}, {sign})")
        elif t["target"].startswith("1gbit N=2"):
            alone = f"; vs compute-alone {t['ratio_compute_alone']:.3f}x" if t.get("ratio_compute_alone") else ""
            name = f"best <= {t['bound']:.2f}x compute-only"
            lines.append(f"{status} {name:<32}{where:<14} best {best} compute (N ranks at once) {peer}{alone})")
        else:
            extra = f", {sign}" if t["peer"] != "compute" else ""
            lines.append(f"{status} {t['target']:<33} {where:<14} {best} {t['peer']} {peer}{extra})")
        for key, what in (("sync", "lockstep alone"), ("wire", "+ the bytes")):
            if t.get(f"{key}_ms"):
                ms, ratio, paired = (t[f"{key}_{x}"] for x in ("ms", "ratio", "paired"))
                floor = f"{ms:.1f} ms = {ratio:.3f}x compute (paired: {paired:.3f}x)"
                lines.append(f"{'':<5}   floor: compute+{key} ({what}){'':<{17 - len(what)}}{where:<14} {floor}")
    return "\n".join(lines)


# a bar's colour: its kind (compute, floors, DDP), else its algorithm; compressed rows purple (DDP's grey)
COLORS = {"compute": "0.75", "wire": "0.55", "sync": "0.45", "ddp": "black"}
COLORS |= {"two-pass": "tab:orange", "ring": "tab:blue", "gloo": "tab:green"}
VALUE_LABEL = dict(ha="center", va="bottom", fontsize=7, xytext=(0, 1), textcoords="offset points")


def bar_color(r: dict) -> str:
    if r.get("compress"):
        return "0.3" if r["kind"] == "ddp" else "tab:purple"
    return COLORS.get(r["kind"] if r["kind"] != "sum" else r["allreduce"], "tab:purple")


def plot(records: list[dict], title: str, rates: list[str | None], worlds: list[int]) -> bytes:
    """One panel per (rate, N): a bar per configuration (median ms/step, whiskers p25..p75), as PNG."""
    from matplotlib.patches import Patch

    factor = bound("compute")
    references = [
        ("compute", 1, dict(color="tab:red", lw=1.2, label="compute-only, all N ranks at once (the baseline)")),
        ("compute", factor, dict(color="tab:red", lw=1, ls="--", label=f"{factor:.2f}x compute-only")),
        ("compute-alone", 1, dict(color="tab:red", lw=1, ls=":", label="compute-only, one rank alone")),
        ("ddp", 1, dict(color="black", lw=0.8, ls="-.", alpha=0.7, label="DDP")),
    ]
    fig, axes = figure(len(rates), len(worlds), (6.4 * len(worlds), 4.6 * len(rates) + 0.6))
    legend = []
    for i, rate in enumerate(rates):
        for j, n in enumerate(worlds):
            ax = axes[i][j]
            rows = [r for r in records if r["rate"] == rate and r["world_size"] == n]
            if not rows:
                ax.set_visible(False)
                continue
            medians = [r["median_ms"] for r in rows]
            err = [[r["median_ms"] - r["p25_ms"] for r in rows], [r["p75_ms"] - r["median_ms"] for r in rows]]
            colors = [bar_color(r) for r in rows]
            bars = ax.bar(range(len(rows)), medians, color=colors, yerr=err, capsize=2, ecolor="0.3", edgecolor="white")
            for b, r in zip(bars, rows):
                middle = b.get_x() + b.get_width() / 2
                if r["overlap"]:
                    b.set_hatch("//")
                # the part of the step spent in sum()/wait() after backward (exposed communication)
                if r["kind"] == "sum" and r["sum_wait_ms"] > 0:
                    waited, bottom = min(r["sum_wait_ms"], r["median_ms"]), max(0.0, r["median_ms"] - r["sum_wait_ms"])
                    ax.bar(middle, waited, bottom=bottom, width=b.get_width() * 0.35, color="white", alpha=0.55)
                ax.annotate(f"{r['median_ms']:.0f}", (middle, r["p75_ms"]), **VALUE_LABEL)
            by = {r["config"]: r["median_ms"] for r in rows}
            for name, times, style in references:
                if name in by:
                    ax.axhline(times * by[name], **style)
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels([r["config"] for r in rows], rotation=35, ha="right", fontsize=8)
            ax.set_ylabel("ms per step (median; whiskers p25..p75)")
            link = f"{rate} per host" if rate else "loopback"
            ax.set_title(f"{link}, N = {n} ranks, batch {rows[0]['batch_size']}/rank")
            ax.set_ylim(0, max(r["p75_ms"] for r in rows) * 1.12)
            ax.grid(True, axis="y", alpha=0.3)
            if not legend:
                legend, _ = ax.get_legend_handles_labels()
    legend += [
        Patch(facecolor="0.6", hatch="//", edgecolor="white", label="+overlap (hatched)"),
        Patch(facecolor="white", edgecolor="0.5", alpha=0.55, label="light inset: time in sum()/wait() after backward"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07 / len(rates), 1, 1))
    return png_of(fig)
