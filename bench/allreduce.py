#!/usr/bin/env python3
"""All-reduce benchmark for utils/ring.py, in the style of nccl-tests.

Measures, side by side in one run, the all-reduce (sum) of one flat float32 buffer with

    gloo                 dist.all_reduce (the reference)
    two-pass             the original chain, chunks=1 (the textbook, unpipelined version)
    two-pass-pipelined   the same chain streamed in auto_chunks(numel) pieces (or --chunks K)
    ring                 reduce-scatter + all-gather
    hierarchical         loopback within hosts, a ring per shard across them (utils/hierarchical.py)

for world sizes N (default 2,3,4) and buffer sizes from 4 KiB to 16 MiB, including the
trainer's gradient ("model", --model-numel float32 values).

Several ranks per host (--ranks-per-host K): N counts hosts, each runs K ranks (N·K in all)
that share its one card (in --cluster mode; on loopback the hosts are faked with RING_HOST_ID).
The limit and busbw then count hosts (2(N-1)/N: what each host's card must carry), and the
targets are the hierarchical ring's: within 1.10x the limit and 1.3x faster than gloo and ring.

Two ways to run it (the driver starts N real rank processes of this same file, --worker):

    python3 bench/allreduce.py                          # loopback, 127.0.0.1
    python3 bench/allreduce.py --cluster --rate 200mbit # emulated hosts (scripts/cluster.py),
                                                        # one rank per host, egress capped

Timing. Per size, every repetition runs every algorithm once (the order rotates from one
repetition to the next), so drift hits all of them alike. One repetition of one algorithm is
    restore the input; dist.barrier(); t0; all-reduce; t1
on every rank; its time is the MAX over ranks of t1 - t0 (an all-reduce is done when its
slowest rank is). After --warmup discarded repetitions, --iters are timed (fewer for the
biggest sizes, see --big-iters); the table shows the MEDIAN.

Columns (nccl-tests conventions; S = buffer bytes, t = median time, MB = 1e6 bytes):
    algbw = S / t        busbw = algbw * 2(N-1)/N
    limit = 2(N-1)/N * S / B  when a per-host egress rate B is known (--cluster --rate):
            the least time ANY all-reduce can take, as every host must send 2(N-1)/N * S
            (payload bytes only; TCP/IP/Ethernet headers cost ~4.6% more on the wire at
            MTU 1500, while tbf's initial burst can give ~10 ms free). At the limit, busbw = B.
    xlimit = t / limit   xgloo = t / t(gloo)
    In cluster mode the target lines also show the wire floor: limit * (MTU+14)/(MTU-52) minus
    the tbf bucket's free start (1.046x at MTU 1500, less for small buffers), what tbf really
    lets through; no algorithm can beat it.

Trying a change to utils/ring.py: --candidate FILE measures FILE's ring_sum as "ring:<stem>",
interleaved with the rest (same checks, same targets, marked [candidate]); --ring-file FILE
swaps the whole module (results go to allreduce-<mode>-<stem>.*, never over the real ones).

Correctness. Rank r's input is float32 N(0,1) from seed (--seed, r), so every rank can build
every input and the float64 reference sum. Every result (warm-up ones too) must be within
(N-1) * 2^-24 * sum_r |x_r| of the reference, element-wise (the worst-case float32 rounding
of N-1 additions in any order), and must be bit-identical on all ranks (blake2b digests).
Any failure: a message naming N, size, algorithm and repetition, and a non-zero exit.

Output: a markdown table on stdout, then the issue targets with PASS/MISS, and
bench/results/allreduce-<mode>[-<rate>].{json,png,md} (mode: loopback or cluster), written atomically.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RESULTS, cluster, fmt, free_port, LaunchError, number_list, OneLineParser, parse_rate, run_driver,
    p_text, ratios_to_gloo, run_world, sign_test_p)
from utils.checkpoint import write_file  # noqa: E402

ALGORITHMS = ("gloo", "two-pass", "two-pass-pipelined", "ring", "hierarchical")
DEFAULT_ALGORITHMS = ("gloo", "two-pass", "two-pass-pipelined", "ring")   # hierarchical: with --ranks-per-host
DEFAULT_SIZES = "4K,16K,64K,256K,1M,model,2M,4M,8M,16M"
DEFAULT_MODEL_NUMEL = 421642          # the trainer's parameter count (float32 gradient)
ELEMENT = 4                           # bytes per float32
MB = 1e6                              # bandwidth unit, as in nccl-tests (GB/s = 1e9 B/s)

# Issue targets (benchmark goals on the capped cluster, not tests):
#   (name, algorithm, world sizes, min bytes, metric, bound)
TARGETS = (
    ("ring <= 1.05x limit, >= 1 MiB", "ring", (2, 3, 4), 1 << 20, "ratio_limit", 1.05),
    ("ring no slower than gloo, >= 1 MiB", "ring", (2, 3, 4), 1 << 20, "ratio_gloo", 1.00),
    ("two-pass-pipelined <= 1.5x limit, >= 4 MiB", "two-pass-pipelined", (4,), 4 << 20, "ratio_limit", 1.50),
)
# With several ranks per host (--ranks-per-host K > 1; world sizes count hosts): issue #18.
HIERARCHICAL_TARGETS = (
    ("hierarchical <= 1.10x limit, >= 1 MiB", "hierarchical", (2, 3), 1 << 20, "ratio_limit", 1.10),
    ("hierarchical >= 1.3x faster than gloo, >= 1 MiB", "hierarchical", (2, 3), 1 << 20, "ratio_gloo", 1 / 1.3),
    ("hierarchical >= 1.3x faster than ring, >= 1 MiB", "hierarchical", (2, 3), 1 << 20, "ratio_ring", 1 / 1.3),
)


# --------------------------------------------------------------------------- helpers
def parse_size(text: str, model_numel: int) -> tuple[str, int]:
    """'4K' / '16M' / '1048576' / 'model' -> (label, bytes); K/M/G are binary (KiB, MiB, GiB)."""
    t = text.strip()
    if t.lower() == "model":
        return "model", model_numel * ELEMENT
    units = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
             "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
    num = t.rstrip("BbKkMmGgIi")
    unit = t[len(num):].upper()
    if not num.isdigit() or unit not in units:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 4K, 1M, 16M, 65536 or 'model'")
    nbytes = int(num) * units[unit]
    if nbytes < ELEMENT or nbytes % ELEMENT:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a positive multiple of {ELEMENT} bytes")
    return human(nbytes), nbytes


def human(nbytes: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B" if nbytes < 1024 else f"{nbytes / 1024:.1f}K"


def pretty_bytes(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.2f} MiB" if nbytes >= 1 << 20 else f"{nbytes / 1024:.1f} KiB"


def expected_seconds(alg: str, n: int, nbytes: int, rate_bytes: float, chunks: int) -> float:
    """Rough bandwidth-bound time of one all-reduce (used for timeouts and sanity only)."""
    s = nbytes / rate_bytes
    if alg in ("gloo", "ring"):
        return 2 * (n - 1) / n * s
    if alg == "two-pass" or chunks <= 1:
        return (n + max(0, n - 2)) * s              # N hops of pass 1, N-2 of pass 2, one after another
    return 2 * s + (2 * n - 2) * s / chunks         # busiest link carries 2S; plus pipeline fill


# --------------------------------------------------------------------------- worker
def worker(args) -> int:
    cfg = json.loads(Path(args.config).read_text())
    rank, n = args.rank, cfg["world_size"]

    import torch
    import torch.distributed as dist
    if cfg["ring_file"]:                    # benchmark another copy of ring.py (e.g. a proposed patch)
        spec = importlib.util.spec_from_file_location("ring_under_test", cfg["ring_file"])
        ring = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ring)
    else:
        from utils import ring
    candidates = {}                         # "ring:<stem>": another ring_sum, measured interleaved
    for path in cfg["candidates"]:
        spec = importlib.util.spec_from_file_location(f"candidate_{len(candidates)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        candidates[f"ring:{Path(path).stem}"] = module.ring_sum

    torch.set_num_threads(1)     # N ranks share the machine's cores
    dist.init_process_group("gloo", init_method=cfg["init_method"], rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=cfg["op_timeout"]))
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    from utils import hierarchical
    hosts = hierarchical.discover()
    # its subgroups, made up front by every rank (made at its first sum, they would be timed)
    hierarchy = hierarchical.Hierarchy(hosts, datetime.timedelta(seconds=cfg["op_timeout"])) \
        if "hierarchical" in cfg["algorithms"] else None
    say(f"  N={n}: {n} ranks up, {hierarchical.describe(hosts)} ({cfg['init_method']}, GLOO_SOCKET_IFNAME="
        f"{os.environ.get('GLOO_SOCKET_IFNAME', '-')}, torch {torch.__version__})")
    if len(hosts) != cfg["hosts"] or any(len(h) != cfg["ranks_per_host"] for h in hosts):
        say(f"  WARNING: expected {cfg['hosts']} hosts × {cfg['ranks_per_host']} ranks")

    def make_input(r: int, numel: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + r)
        return torch.randn(numel, generator=g, dtype=torch.float32)

    def run(alg: str, buf: torch.Tensor, chunks: int) -> None:
        if alg == "gloo":
            ring.gloo_sum(buf)
        elif alg == "ring":
            ring.ring_sum(buf)
        elif alg == "hierarchical":
            hierarchy.sum_(buf)
        elif alg in candidates:
            candidates[alg](buf)
        else:
            ring.two_pass_ring_sum(buf, chunks)

    out = {"world_size": n, "sizes": []}
    failures = []
    for size in cfg["sizes"]:
        numel = size["bytes"] // ELEMENT
        reps_warm, reps_timed = size["warmup"], size["iters"]
        inputs = [make_input(r, numel) for r in range(n)]
        mine = inputs[rank]
        ref = torch.zeros(numel, dtype=torch.float64)
        abs_sum = torch.zeros(numel, dtype=torch.float64)
        for x in inputs:
            ref += x.double()
            abs_sum += x.double().abs()
        bound = abs_sum.mul_((n - 1) * 2.0 ** -24).add_(1e-30)   # worst-case float32 rounding
        del inputs, abs_sum
        buf = torch.empty_like(mine)
        plan = {alg: (1 if alg == "two-pass" else
                      (cfg["chunks"] or ring.auto_chunks(numel)) if alg == "two-pass-pipelined" else 0)
                for alg in cfg["algorithms"] + list(candidates)}
        times = {alg: [] for alg in plan}        # this rank's t1 - t0, timed repetitions
        digests = {alg: [] for alg in plan}      # per repetition (warm-up included)
        errors = {alg: [] for alg in plan}       # max |err| / bound per repetition
        algs = list(plan)
        for rep in range(reps_warm + reps_timed):
            for alg in algs[rep % len(algs):] + algs[:rep % len(algs)]:   # rotate the order
                buf.copy_(mine)
                dist.barrier()
                t0 = time.perf_counter()
                run(alg, buf, plan[alg])
                t1 = time.perf_counter()
                if cfg["fault"] and alg == "ring":                  # self-test of the checks below
                    if cfg["fault"] == "wrong":
                        buf[numel // 2] += 1.0                      # same wrong value on every rank
                    elif rank == n - 1:                             # "diverge": one rank 1 ulp off
                        buf[numel // 2] = torch.nextafter(buf[numel // 2], torch.tensor(math.inf))
                if rep >= reps_warm:
                    times[alg].append(t1 - t0)
                err = (buf.double() - ref).abs_().div_(bound).max().item() if numel else 0.0
                errors[alg].append(err if math.isfinite(err) else float("inf"))
                digests[alg].append(hashlib.blake2b(buf.numpy().tobytes(), digest_size=16).hexdigest())
        everyone = [None] * n
        dist.all_gather_object(everyone, {"times": times, "digests": digests, "errors": errors})

        rows = []
        for alg in algs:
            per_rank = [e["times"][alg] for e in everyone]
            t_max = [max(ts) for ts in zip(*per_rank)]           # slowest rank, per repetition
            worst_err = max(max(e["errors"][alg]) for e in everyone)
            mismatched = [rep for rep in range(reps_warm + reps_timed)
                          if len({e["digests"][alg][rep] for e in everyone}) != 1]
            problems = []
            if worst_err > 1.0:
                bad = [(r, rep) for r, e in enumerate(everyone)
                       for rep, v in enumerate(e["errors"][alg]) if v > 1.0]
                problems.append(f"wrong sum: error up to {worst_err:.3g}x the float32 rounding bound "
                                f"(rank, repetition incl. warm-up: {bad[:6]})")
            if mismatched:
                problems.append(f"ranks disagree bit-wise in repetitions {mismatched[:6]} (incl. warm-up)")
            for p in problems:
                failures.append(f"N={n} size={size['label']} algorithm={alg}: {p}")
            rows.append({"algorithm": alg, "chunks": plan[alg] or None, "times_s": t_max,
                         "rank_median_s": [statistics.median(ts) for ts in per_rank],
                         "max_error_over_bound": worst_err, "bit_identical": not mismatched,
                         "correct": not problems, "problems": problems})
        out["sizes"].append({**size, "numel": numel, "rows": rows})
        say(f"  N={n} {size['label']:>6} ({reps_timed} iters): " + "  ".join(
            f"{r['algorithm']} {statistics.median(r['times_s']) * 1e3:.2f}ms"
            + ("" if r["correct"] else " WRONG") for r in rows))
        del ref, bound, buf

    out["failures"] = failures
    if rank == 0:
        write_file(Path(cfg["out"]), json.dumps(out).encode())
    dist.barrier()
    dist.destroy_process_group()
    return 3 if failures else 0


# --------------------------------------------------------------------------- driver
def cpu_ticks() -> dict[int, tuple[int, str]]:
    """{pid: (utime + stime clock ticks, command name)} of every process now."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            head, tail = stat.rsplit(")", 1)
            fields = tail.split()
            out[int(d)] = (int(fields[11]) + int(fields[12]), head.split("(", 1)[1])
    return out


def load_snapshot() -> dict:
    """What the machine's CPUs are doing: all processes' CPU ticks, /proc/stat totals, our
    reaped children's CPU seconds, a clock."""
    import resource
    cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"procs": cpu_ticks(), "busy": sum(cpu) - cpu[3] - cpu[4], "total": sum(cpu),
            "children": ru.ru_utime + ru.ru_stime, "t": time.monotonic()}


def other_load(before: dict, after: dict, ours: set[int]) -> dict:
    """How busy the machine was besides our ranks between two snapshots (taken after our ranks
    were reaped). busy_cores: all CPUs (kernel networking included); ours_cores: our ranks;
    others_cores: other processes alive at the end (processes that came and went are missed)."""
    hz, wall = os.sysconf("SC_CLK_TCK"), max(after["t"] - before["t"], 1e-9)
    used = sorted(((t - before["procs"].get(pid, (0, ""))[0], name, pid)
                   for pid, (t, name) in after["procs"].items() if pid not in ours and pid != os.getpid()),
                  reverse=True)
    used = [u for u in used if u[0] > 0]
    return {"busy_cores": round((after["busy"] - before["busy"]) / max(after["total"] - before["total"], 1)
                                * os.cpu_count(), 2),
            "ours_cores": round((after["children"] - before["children"]) / wall, 2),
            "others_cores": round(sum(u[0] for u in used) / hz / wall, 2),
            "others_top": [f"{name}[{pid}] {d / hz / wall:.2f}" for d, name, pid in used[:4]]}


def launch(n: int, args, sizes: list[dict], cl, tmp: Path, port: int, op_timeout: float,
           timeout: float) -> dict:
    """Run one world of n hosts × --ranks-per-host ranks; return rank 0's raw results (with the
    hosts). Kills every child on any exit."""
    cfg_path, out_path = tmp / f"config-{n}.json", tmp / f"result-{n}.json"
    host0 = cl.addr(0) if cl else "127.0.0.1"
    k = args.ranks_per_host
    cfg = {"world_size": n * k, "hosts": n, "ranks_per_host": k,
           "init_method": f"tcp://{host0}:{port}", "op_timeout": op_timeout,
           "seed": args.seed, "chunks": args.chunks, "fault": args.self_test_fault,
           "ring_file": str(Path(args.ring_file).resolve()) if args.ring_file else None, "algorithms": args.algorithms,
           "candidates": [str(Path(f).resolve()) for f in args.candidate],
           "sizes": sizes, "out": str(out_path)}
    cfg_path.write_text(json.dumps(cfg))
    load_before = load_snapshot()
    procs = run_world(str(Path(__file__).resolve()), n * k, cfg_path, cl, f"rank{{rank}}-n{n}.log", timeout,
                      f"N={n}", ok_codes=(0, 3), ranks_per_host=k)
    if not out_path.exists():
        raise LaunchError(f"N={n}: the ranks exited without writing {out_path}")
    raw = json.loads(out_path.read_text())
    raw["hosts"], raw["ranks_per_host"] = n, k
    raw["load"] = load = other_load(load_before, load_snapshot(), {p.pid for p in procs})
    if load["others_cores"] > 0.1 or load["busy_cores"] - load["ours_cores"] > 0.6:
        print(f"  WARNING N={n}: the machine was busy besides this benchmark: {load['busy_cores']:.2f} of "
              f"{os.cpu_count()} cores busy, our ranks {load['ours_cores']:.2f}, other processes "
              f"{load['others_cores']:.2f} ({', '.join(load['others_top'])}); timings may be inflated",
              flush=True)
    return raw


def summarize(raw: dict, rate_bytes: float | None) -> list[dict]:
    """Raw per-world results -> one flat record per (N, size, algorithm) with derived columns."""
    records = []
    n = raw["world_size"]
    hosts, k = raw.get("hosts", n), raw.get("ranks_per_host", 1)   # the limit counts hosts: their cards
    for size in raw["sizes"]:
        gloo_t = next((statistics.median(r["times_s"]) for r in size["rows"] if r["algorithm"] == "gloo"), None)
        ring_t = next((statistics.median(r["times_s"]) for r in size["rows"] if r["algorithm"] == "ring"), None)
        for row in size["rows"]:
            t = statistics.median(row["times_s"])
            algbw = size["bytes"] / t
            limit = 2 * (hosts - 1) / hosts * size["bytes"] / rate_bytes if rate_bytes else None
            records.append({
                "world_size": n, "hosts": hosts, "ranks_per_host": k,
                "size": size["label"], "bytes": size["bytes"], "numel": size["numel"],
                "algorithm": row["algorithm"], "chunks": row["chunks"], "iters": len(row["times_s"]),
                "warmup": size["warmup"], "times_ms": [x * 1e3 for x in row["times_s"]],
                "median_ms": t * 1e3, "min_ms": min(row["times_s"]) * 1e3, "max_ms": max(row["times_s"]) * 1e3,
                "rank_median_ms": [x * 1e3 for x in row["rank_median_s"]],
                "algbw_MBps": algbw / MB, "busbw_MBps": algbw * 2 * (hosts - 1) / hosts / MB,
                "limit_ms": limit * 1e3 if limit else None, "ratio_limit": t / limit if limit else None,
                "ratio_gloo": t / gloo_t if gloo_t else None,
                "ratio_ring": t / ring_t if ring_t and row["algorithm"] != "ring" else None,
                "correct": row["correct"], "bit_identical": row["bit_identical"],
                "max_error_over_bound": row["max_error_over_bound"], "problems": row["problems"]})
    return records


def table(records: list[dict]) -> str:
    head = ("| N | size | bytes | algorithm | chunks | iters | time ms | spread | algbw MB/s | busbw MB/s "
            "| limit ms | x limit | x gloo | ok |")
    align = ["--:", ":--", "--:", ":--", "--:", "--:", "--:", "--:", "--:", "--:", "--:", "--:", "--:", ":-:"]
    lines = [head, "|" + "|".join(align) + "|"]
    for r in records:
        spread = (r["max_ms"] - r["min_ms"]) / r["median_ms"] * 100
        lines.append("| " + " | ".join([
            world_label(r), r["size"], str(r["bytes"]), r["algorithm"], fmt(r["chunks"], "{}"),
            str(r["iters"]), fmt(r["median_ms"], "{:.3f}" if r["median_ms"] < 10 else "{:.1f}"),
            f"{spread:.0f}%", fmt(r["algbw_MBps"]), fmt(r["busbw_MBps"]),
            fmt(r["limit_ms"], "{:.2f}"), fmt(r["ratio_limit"], "{:.3f}"), fmt(r["ratio_gloo"], "{:.2f}"),
            "yes" if r["correct"] else "**NO**"]) + " |")
    return "\n".join(lines)


def world_label(r: dict) -> str:
    """N for one rank per host, "2×4" (hosts × ranks each) for several."""
    k = r.get("ranks_per_host", 1)
    return str(r["world_size"]) if k == 1 else f"{r['hosts']}×{k}"


def evaluate_targets(records: list[dict], mode: str, ranks_per_host: int = 1) -> list[dict]:
    """Targets per number of hosts (N): TARGETS with one rank per host, HIERARCHICAL_TARGETS with several."""
    out = []
    candidates = sorted({r["algorithm"] for r in records if r["algorithm"].startswith("ring:")})
    targets = list(TARGETS) + [(name.replace("ring", c, 1) + " [candidate]", c, *rest)
                               for c in candidates for name, alg, *rest in TARGETS if alg == "ring"]
    if ranks_per_host > 1:
        targets = list(HIERARCHICAL_TARGETS)
    for name, alg, worlds, min_bytes, metric, bound in targets:
        for n in worlds:
            rows = [r for r in records if r["algorithm"] == alg and r.get("hosts", r["world_size"]) == n
                    and r["bytes"] >= min_bytes and r.get(metric) is not None]
            label = str(n) if ranks_per_host == 1 else f"{n}×{ranks_per_host}"
            if mode != "cluster" or not rows:
                why = "targets are for --cluster --rate" if mode != "cluster" else "not measured"
                out.append({"target": name, "world_size": n, "label": label, "status": "N/A", "why": why})
                continue
            worst = max(rows, key=lambda r: r[metric])
            out.append({"target": name, "world_size": n, "label": label, "bound": bound, "metric": metric,
                        "status": "PASS" if worst[metric] <= bound else "MISS",
                        "worst_ratio": worst[metric], "worst_size": worst["size"],
                        "wire_floor": {r["size"]: round(r["floor_ratio"], 3) for r in rows if "floor_ratio" in r}
                        if metric == "ratio_limit" else {},
                        "per_size": {r["size"]: round(r[metric], 4) for r in rows},
                        "paired": paired_vs_gloo(records, rows) if metric == "ratio_gloo" else
                                  paired_vs_gloo(records, rows, "ring") if metric == "ratio_ring" else {}})
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
            out[r["size"]] = [round(statistics.median(ratios), 4), faster, len(ratios),
                              round(sign_test_p(faster, len(ratios)), 3)]
    return out


def target_lines(targets: list[dict]) -> str:
    lines = []
    for t in targets:
        if t["status"] == "N/A":
            lines.append(f"N/A   {t['target']:<50} N={t.get('label', t['world_size'])}  ({t['why']})")
            continue
        sizes = "  ".join(f"{k} {v:.3f}" for k, v in t["per_size"].items())
        lines.append(f"{t['status']:<5} {t['target']:<50} N={t.get('label', t['world_size'])}  worst {t['worst_ratio']:.3f}x "
                     f"at {t['worst_size']} (bound {t['bound']:.2f})   [{sizes}]")
        if t.get("wire_floor") and not t["target"].startswith("two-pass"):
            floors = "  ".join(f"{k} {v:.3f}" for k, v in t["wire_floor"].items())
            lines.append(f"{'':<5} {'  wire floor of any all-reduce, same sizes':<50} N={t.get('label', t['world_size'])}  [{floors}]")
        if t.get("paired"):
            paired = "  ".join(f"{k} {m:.3f} ({faster}/{total}, {p_text(p)})"
                               for k, (m, faster, total, p) in t["paired"].items())
            lines.append(f"{'':<5} {'  paired per repetition (faster in k/n, p)':<50} N={t.get('label', t['world_size'])}  [{paired}]")
    return "\n".join(lines)


def load_lines(load: dict) -> str:
    lines = []
    for n, v in load.items():
        busy = v["others_cores"] > 0.1 or v["busy_cores"] - v["ours_cores"] > 0.6
        lines.append(f"load  N={n}: {v['busy_cores']:.2f} of {os.cpu_count()} cores busy, our ranks {v['ours_cores']:.2f}, "
                     f"other processes {v['others_cores']:.2f}" + ("  <- NOT QUIET, timings may be inflated" if busy else ""))
    return "\n".join(lines)


def plot(records: list[dict], path: Path, title: str, rate_bytes: float | None, burst_bytes: int = 0) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import io

    worlds = sorted({r["world_size"] for r in records})
    fig, axes = plt.subplots(2, len(worlds), figsize=(5.2 * len(worlds), 8.2), squeeze=False, sharex=True)
    style = {"gloo": ("k", "o", "-"), "two-pass": ("tab:red", "s", "--"),
             "two-pass-pipelined": ("tab:orange", "^", "-"), "ring": ("tab:blue", "D", "-"),
             "hierarchical": ("tab:green", "P", "-")}
    for col, n in enumerate(worlds):
        first = next(r for r in records if r["world_size"] == n)
        hosts = first.get("hosts", n)                # the limit counts hosts (their cards)
        top, bottom = axes[0][col], axes[1][col]
        extra = sorted({r["algorithm"] for r in records} - set(ALGORITHMS))
        for alg in [*ALGORITHMS, *extra]:
            rows = sorted((r for r in records if r["world_size"] == n and r["algorithm"] == alg),
                          key=lambda r: r["bytes"])
            if not rows:
                continue
            c, m, ls = style.get(alg) or (("tab:purple", "tab:brown", "tab:pink", "tab:olive")[extra.index(alg) % 4],
                                          "v", "-.")
            x = [r["bytes"] for r in rows]
            top.plot(x, [r["median_ms"] for r in rows], color=c, marker=m, ls=ls, ms=4, label=alg)
            top.fill_between(x, [r["min_ms"] for r in rows], [r["max_ms"] for r in rows], color=c, alpha=0.12)
            bottom.plot(x, [r["busbw_MBps"] for r in rows], color=c, marker=m, ls=ls, ms=4, label=alg)
        xs = sorted({r["bytes"] for r in records if r["world_size"] == n})
        if rate_bytes:
            top.plot(xs, [2 * (hosts - 1) / hosts * s / rate_bytes * 1e3 for s in xs], color="0.5", ls=":",
                     lw=2, label="bandwidth limit 2(N-1)/N·S/B")
            bottom.axhline(rate_bytes / MB, color="0.5", ls=":", lw=2, label=f"busbw at the limit = B = {rate_bytes / MB:g} MB/s")
            # Small buffers ride on tbf's bucket (sent at veth speed): busbw there says nothing about
            # the rate, so shade them and clip the axis to keep the bandwidth-bound sizes readable.
            fits = [x for x in xs if 2 * (hosts - 1) / hosts * x <= burst_bytes]
            if fits:
                for ax in (top, bottom):
                    ax.axvspan(xs[0] / 1.2, fits[-1] * 1.2, color="0.92", zorder=0)
                bottom.text(fits[0], rate_bytes / MB * 1.55, "fits in the tbf burst", fontsize=8, va="top", color="0.4")
            bottom.set_ylim(0, rate_bytes / MB * 1.6)
        for r in records:
            if r["size"] == "model" and r["world_size"] == n:
                for ax in (top, bottom):
                    ax.axvline(r["bytes"], color="tab:green", lw=0.8, alpha=0.6)
                top.annotate("model", (r["bytes"], 0.02), xycoords=("data", "axes fraction"),
                             color="tab:green", fontsize=8, rotation=90, ha="right", va="bottom")
                break
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
    extra_h, extra_l = axes[1][0].get_legend_handles_labels()
    handles += [h for h, l in zip(extra_h, extra_l) if l.startswith("busbw at")]
    labels += [l for l in extra_l if l.startswith("busbw at")]
    fig.suptitle(title, fontsize=11)
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=9, frameon=False,
               bbox_to_anchor=(0.5, 0.965))
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_file(path, buf.getvalue())


def driver(args) -> int:
    mode = "cluster" if args.cluster else "loopback"
    if (args.rate or args.tcp_cc) and not args.cluster:
        print("allreduce.py: --rate and --tcp-cc only apply with --cluster", file=sys.stderr)
        return 2
    rate_bits = parse_rate(args.rate) if args.cluster and args.rate else None
    k = args.ranks_per_host
    rate_bytes = rate_bits / 8 if rate_bits else None
    worlds = args.world_sizes
    sizes = {}
    for label, nbytes in args.sizes:       # one row per byte count; "model" keeps its name
        sizes[nbytes] = label if label == "model" else sizes.get(nbytes, label)
    sizes = sorted(sizes.items())
    plan = []
    for nbytes, label in sizes:
        big = nbytes >= args.big_from
        plan.append({"label": label, "bytes": nbytes, "iters": args.big_iters if big else args.iters,
                     "warmup": args.big_warmup if big else args.warmup})

    # Time budget per world (the hard timeout) and per-operation timeout of the process group.
    from utils.ring import auto_chunks
    est = {n: sum((p["iters"] + p["warmup"]) * expected_seconds(       # N·K ranks: a flat ring's time
                      a, n * k, p["bytes"], rate_bytes or 50e6, args.chunks or auto_chunks(p["bytes"] // ELEMENT))
                  for p in plan for a in args.algorithms + ["ring"] * len(args.candidate))
           for n in worlds}
    op_timeout = max(60.0, 20 * max(expected_seconds("two-pass", n * k, plan[-1]["bytes"], rate_bytes or 50e6, 1)
                                     for n in worlds))
    print(f"# all-reduce benchmark: mode={mode}" + (f", egress cap {args.rate} per host" if rate_bits else "")
          + f", N={','.join(map(str, worlds))}" + (f" hosts × {k} ranks each" if k > 1 else "")
          + f", algorithms={','.join(args.algorithms)}"
          + (f", ring.py under test: {args.ring_file}" if args.ring_file else "")
          + "".join(f", ring:{Path(f).stem} = ring_sum of {f}" for f in args.candidate))
    labels = [p["label"] + (f" ({pretty_bytes(p['bytes'])})" if p["label"] == "model" else "") for p in plan]
    print(f"# sizes: {', '.join(labels)}")
    iters_note = f"{args.iters} timed + {args.warmup} warm-up repetitions"
    if any(p["bytes"] >= args.big_from for p in plan):
        iters_note += (f"; sizes >= {human(args.big_from)}: {args.big_iters} timed + {args.big_warmup} warm-up "
                       f"(fewer, to keep the run short)")
    print(f"# {iters_note}; time = max over ranks, median over repetitions")
    print("# bandwidth-bound estimate: " + ", ".join(f"N={n} ~{est[n]:.0f}s" for n in worlds)
          + (" (at the cap)" if rate_bits else " (assuming 50 MB/s)"))
    sys.stdout.flush()

    cl, wire, errors = None, None, (LaunchError,)
    if args.cluster:
        errors += (cluster.ClusterError,)
    records, started, load = [], time.time(), {}
    with tempfile.TemporaryDirectory(prefix="allreduce-bench-") as tmpdir:
        tmp = Path(tmpdir)
        stack = None
        try:
            if args.cluster:
                stack = cluster.Cluster(hosts=max(worlds), rate=args.rate, ranks_per_host=k)
                cl = stack.__enter__()
                if args.tcp_cc:                 # per-namespace setting; only kernel-"allowed" ones work there
                    for r in range(cl.hosts):
                        done = cl.run_on(r, ["sysctl", "-q", "-w", f"net.ipv4.tcp_congestion_control={args.tcp_cc}"],
                                         timeout=10)
                        if done.returncode:
                            allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().strip()
                            raise LaunchError(f"--tcp-cc {args.tcp_cc}: {done.stderr.decode().strip()} (a network "
                                              f"namespace may only pick from net.ipv4.tcp_allowed_congestion_control "
                                              f"= {allowed!r})")
                mtu = int(cl.run_on(0, ["cat", f"/sys/class/net/{cl.nic(0)}/mtu"], timeout=10, check=True).stdout)
                cc = cl.run_on(0, ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"], timeout=10).stdout.strip()
                wire = {"mtu": mtu, "factor": (mtu + 14) / (mtu - 52), "tcp_cc": cc.decode() or "?",
                        "burst_bytes": cluster.tbf_burst(rate_bits) if rate_bits else 0}
                print(f"# cluster: {cl.hosts} hosts {', '.join(f'{cl.addr(r)}/{cl.nic(r)}' for r in range(cl.hosts))}, "
                      f"MTU {mtu}, TCP {wire['tcp_cc']}" + (f"; tbf rate {rate_bits} bit/s, burst {wire['burst_bytes']} B, "
                                      f"latency {cluster.TBF_LATENCY}" if rate_bits else ""))
            for i, n in enumerate(worlds):
                timeout = args.timeout or (120 + 3 * est[n])
                port = (29500 + 10 * i + os.getpid() % 7) if cl else free_port()
                t = time.time()
                raw = launch(n, args, plan, cl, tmp, port, op_timeout, timeout)
                print(f"  N={n}: done in {time.time() - t:.0f}s (hard timeout {timeout:.0f}s)", flush=True)
                records += summarize(raw, rate_bytes)
                load[n] = raw["load"]
        except errors as e:
            print(f"allreduce.py: FAILED: {e}", file=sys.stderr)
            return 2
        finally:
            if stack is not None:
                stack.__exit__(None, None, None)

    failures = [f"N={r['world_size']} size={r['size']} algorithm={r['algorithm']}: {p}"
                for r in records for p in r["problems"]]
    if wire and rate_bytes:
        # What the wire allows: tbf charges a whole frame (payload + 66 bytes of Ethernet/IP/TCP
        # headers with timestamps) per MSS of payload, and its bucket starts each op full.
        for r in records:
            if r["limit_ms"]:
                r["floor_ratio"] = max(0.0, wire["factor"] - wire["burst_bytes"] / rate_bytes / (r["limit_ms"] / 1e3))
    targets = evaluate_targets(records, mode, k)
    title = (f"all-reduce, {mode}" + (f", {args.rate} egress per host" if rate_bits else " (127.0.0.1)")
             + f"; {platform.node()}, torch {__import__('torch').__version__}")
    md = (f"### All-reduce benchmark, {mode}" + (f" ({args.rate} per host)" if rate_bits else "")
          + (f", {k} ranks per host (N counts hosts)" if k > 1 else "") + "\n\n"
          f"`{' '.join(['python3', 'bench/allreduce.py'] + sys.argv[1:])}`  \n{iters_note}.\n\n"
          + table(records) + "\n\n```\n" + target_lines(targets) + "\n" + load_lines(load) + "\n```\n")
    result = {
        "mode": mode, "rate": args.rate if rate_bits else None, "rate_bits_per_s": rate_bits,
        "command": [Path(sys.executable).name, "bench/allreduce.py"] + sys.argv[1:],
        "world_sizes": worlds, "ranks_per_host": k, "sizes": plan, "algorithms": args.algorithms,
        "chunks_override": args.chunks,
        "model_numel": args.model_numel, "seed": args.seed,
        "ring_file": args.ring_file or "utils/ring.py", "candidates": args.candidate,
        "timing": "per repetition: barrier, t0, op, t1 on every rank; time = max over ranks; "
                  "median over timed repetitions; algorithms interleaved per repetition, order rotated",
        "host": {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "torch": __import__("torch").__version__, "kernel": platform.release()},
        "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "seconds": round(time.time() - started, 1),
        "other_load": {str(n): v for n, v in load.items()},
        "wire": wire,
        "correct": not failures, "failures": failures, "targets": targets, "results": records,
    }
    out_dir = Path(args.results_dir)
    stem = results_stem(mode, args.rate if rate_bits else None, args.ring_file, args.tcp_cc, k)
    write_file(out_dir / f"{stem}.json", (json.dumps(result, indent=1) + "\n").encode())  # the real ring's
    write_file(out_dir / f"{stem}.md", md.encode())
    plot(records, out_dir / f"{stem}.png", title, rate_bytes, wire["burst_bytes"] if wire else 0)

    print()
    print(table(records))
    print()
    print("Targets" + ("" if mode == "cluster" else " (only evaluated with --cluster --rate)") + ":")
    print(target_lines(targets))
    print(load_lines(load))
    print(f"\nwrote {out_dir / f'{stem}.json'}, .md, .png  ({time.time() - started:.0f}s)")
    if failures:
        print("\nallreduce.py: CORRECTNESS FAILURE:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


def results_stem(mode: str, rate: str | None, ring_file: str | None, tcp_cc: str | None,
                 ranks_per_host: int = 1) -> str:
    """The results files' name: each capped rate, ring file, TCP setting and number of ranks per
    host gets its own, so that no run overwrites another's (allreduce-cluster-200mbit-reno.*,
    allreduce-loopback.*, allreduce-cluster-200mbit-reno-2-per-host.*)."""
    parts = [f"allreduce-{mode}", rate, Path(ring_file).stem if ring_file else None, tcp_cc,
             f"{ranks_per_host}-per-host" if ranks_per_host > 1 else None]
    return "-".join(part for part in parts if part)


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--cluster", action="store_true", help="run each rank on its own emulated host (root)")
    ap.add_argument("--rate", help="per-host egress cap in --cluster mode, tc syntax, e.g. 200mbit")
    ap.add_argument("--world-sizes", default="2,3,4", type=number_list(int),
                    help="comma list of N, one launch each (default 2,3,4)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma list (K/M binary, 'model'); default {DEFAULT_SIZES}")
    ap.add_argument("--model-numel", type=int, default=DEFAULT_MODEL_NUMEL,
                    help="float32 parameters of the trainer's model: the 'model' row")
    ap.add_argument("--algorithms", type=lambda s: s.split(","),
                    help=f"comma list from {','.join(ALGORITHMS)} (default: all but hierarchical; with "
                         f"--ranks-per-host: gloo,ring,hierarchical)")
    ap.add_argument("--ranks-per-host", type=int, default=1, metavar="K",
                    help="K ranks on each host, sharing its card; --world-sizes then counts hosts (default 1)")
    ap.add_argument("--chunks", type=int, default=0, help="pieces for two-pass-pipelined (default: auto_chunks)")
    ap.add_argument("--iters", type=int, default=7, help="timed repetitions")
    ap.add_argument("--warmup", type=int, default=2, help="discarded repetitions first")
    ap.add_argument("--big-from", default="8M", help="sizes from here use --big-iters/--big-warmup")
    ap.add_argument("--big-iters", type=int, default=5)
    ap.add_argument("--big-warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--ring-file", help="benchmark this copy of utils/ring.py instead (e.g. a proposed patch)")
    ap.add_argument("--tcp-cc", metavar="ALGO", help="TCP congestion control inside the emulated hosts (e.g. reno; "
                    "default: the namespaces' default, usually the host's). Results go to allreduce-cluster-<RATE>-<ALGO>.*")
    ap.add_argument("--candidate", action="append", default=[], metavar="RING_PY",
                    help="also measure this file's ring_sum, interleaved with the others, as 'ring:<file stem>' "
                         "(e.g. a proposed patch of utils/ring.py); repeatable")
    ap.add_argument("--timeout", type=float, default=0, help="hard limit per world size in s (default: from the plan)")
    ap.add_argument("--results-dir", default=str(RESULTS))
    ap.add_argument("--self-test-fault", choices=("wrong", "diverge"), help=argparse.SUPPRESS)  # tests only
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    try:
        args.sizes = [parse_size(s, args.model_numel) for s in args.sizes.split(",") if s.strip()]
        args.big_from = parse_size(args.big_from, args.model_numel)[1]
        if args.rate:
            parse_rate(args.rate)
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if args.algorithms is None:
        args.algorithms = list(DEFAULT_ALGORITHMS if args.ranks_per_host == 1 else ("gloo", "ring", "hierarchical"))
    bad = [a for a in args.algorithms if a not in ALGORITHMS]
    if bad or not args.algorithms:
        ap.error(f"unknown algorithm(s) {bad}; choose from {', '.join(ALGORITHMS)}")
    if not 1 <= args.ranks_per_host <= cluster.MAX_RANKS_PER_HOST:
        ap.error(f"--ranks-per-host must be 1..{cluster.MAX_RANKS_PER_HOST}, got {args.ranks_per_host}")
    if any(n < 2 for n in args.world_sizes) and args.ranks_per_host == 1:
        ap.error("world sizes must be >= 2")
    if any(n < 1 for n in args.world_sizes):
        ap.error("world sizes (hosts) must be >= 1")
    if min(args.iters, args.big_iters) < 1 or min(args.warmup, args.big_warmup) < 0 or args.chunks < 0:
        ap.error("--iters/--big-iters must be >= 1, --warmup/--big-warmup and --chunks >= 0")
    if args.cluster and not args.rate:
        ap.error("--cluster needs --rate, e.g. --rate 200mbit: the limit and the targets are for capped links")
    for option, path in [("--ring-file", args.ring_file)] + [("--candidate", f) for f in args.candidate]:
        if path and not Path(path).is_file():
            ap.error(f"{option} {path}: no such file")

    return run_driver(driver, args, "allreduce.py")


if __name__ == "__main__":
    sys.exit(main())
