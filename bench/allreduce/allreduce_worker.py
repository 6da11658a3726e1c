"""bench/allreduce/allreduce.py's ranks: every algorithm's sum of one buffer per size, interleaved, timed, and
checked against a float64 reference and for bit-identical results on every rank.

The kernels are called directly (utils/comm/ring.py's functions, a utils.comm.hierarchical.Hierarchy made
up front), or another copy of ring.py (--ring-file) and candidates' ring_sum (--candidate).
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.util
import math
import os
import statistics
import time
from pathlib import Path

from harness import end_worker, rotated, start_worker

ELEMENT = 4  # bytes per float32


def load_module(path: str, name: str):
    """The module of the Python file at `path` (another ring.py, a candidate's)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sums(cfg: dict, say) -> tuple[dict, object]:
    """{algorithm: f(buffer, chunks)} for every algorithm and candidate of cfg, and the ring module."""
    import torch

    from utils.comm import hierarchical
    from utils.comm import ring as default_ring

    ring = load_module(cfg["ring_file"], "ring_under_test") if cfg["ring_file"] else default_ring
    import torch.distributed as dist

    host_ids = cfg.get("host_ids")  # (on loopback, several ranks to a host: each faked by its id)
    hosts = hierarchical.discover(host_ids[dist.get_rank()] if host_ids else None)
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "-")
    where = f"{cfg['init_method']}, GLOO_SOCKET_IFNAME={ifname}, torch {torch.__version__}"
    say(f"  N={cfg['world_size']}: {cfg['world_size']} ranks up, {hierarchical.describe(hosts)} ({where})")
    if len(hosts) != cfg["hosts"] or any(len(h) != cfg["ranks_per_host"] for h in hosts):
        say(f"  WARNING: expected {cfg['hosts']} hosts × {cfg['ranks_per_host']} ranks")
    run = {"gloo": lambda b, c: ring.gloo_sum(b), "ring": lambda b, c: ring.ring_sum(b)}
    run |= {"two-pass": ring.two_pass_ring_sum, "two-pass-pipelined": ring.two_pass_ring_sum}
    if "hierarchical" in cfg["algorithms"]:  # its subgroups, made up front (made at its first sum, they would be timed)
        hierarchy = hierarchical.Hierarchy(hosts, datetime.timedelta(seconds=cfg["op_timeout"]))
        run["hierarchical"] = lambda b, c: hierarchy.sum_(b)
    algorithms = {a: run[a] for a in cfg["algorithms"]}
    for i, path in enumerate(cfg["candidates"]):  # "ring:<stem>": another ring_sum, measured interleaved
        ring_sum = load_module(path, f"candidate_{i}").ring_sum
        algorithms[f"ring:{Path(path).stem}"] = lambda b, c, f=ring_sum: f(b)
    return algorithms, ring


def worker(args) -> int:
    cfg, say = start_worker(args, deterministic=False)
    algorithms, ring = sums(cfg, say)
    out, failures = {"world_size": cfg["world_size"], "sizes": []}, []
    for size in cfg["sizes"]:
        numel = size["bytes"] // ELEMENT
        chunks = {"two-pass": 1, "two-pass-pipelined": cfg["chunks"] or ring.auto_chunks(numel)}
        rows = time_size(cfg, args.rank, size, {a: (f, chunks.get(a, 0)) for a, f in algorithms.items()})
        where = f"N={cfg['world_size']} size={size['label']} algorithm="
        failures += [f"{where}{r['algorithm']}: {p}" for r in rows for p in r["problems"]]
        out["sizes"].append({**size, "numel": numel, "rows": rows})
        times = "  ".join(
            f"{r['algorithm']} {statistics.median(r['times_s']) * 1e3:.2f}ms" + ("" if r["correct"] else " WRONG")
            for r in rows
        )
        say(f"  N={cfg['world_size']} {size['label']:>6} ({size['iters']} iters): {times}")
    end_worker(cfg, args.rank, out | {"failures": failures})
    return 3 if failures else 0


def time_size(cfg: dict, rank: int, size: dict, plan: dict) -> list[dict]:
    """Every algorithm of plan ({name: (sum, chunks)}) on one buffer size, the order rotated per
    repetition: per algorithm the time (max over ranks) of each timed repetition and its checks."""
    import torch
    import torch.distributed as dist

    from utils.exchange import all_gather_json

    n, numel = cfg["world_size"], size["bytes"] // ELEMENT
    warm, reps = size["warmup"], size["warmup"] + size["iters"]
    seeds = [cfg["seed"] * 1_000_003 + r for r in range(n)]
    inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(seed)) for seed in seeds]
    mine, ref = inputs[rank], sum(x.double() for x in inputs)
    bound = sum(x.double().abs() for x in inputs).mul_((n - 1) * 2.0**-24).add_(1e-30)  # worst-case float32 rounding
    del inputs
    buf = torch.empty_like(mine)
    times, digests, errors = ({alg: [] for alg in plan} for _ in range(3))  # this rank's t1 - t0 of the timed ones
    for rep in range(reps):
        for alg in rotated(list(plan), rep):
            buf.copy_(mine)
            dist.barrier()
            t0 = time.perf_counter()
            plan[alg][0](buf, plan[alg][1])
            t1 = time.perf_counter()
            if cfg["fault"] and alg == "ring":  # self-test of the checks below
                if cfg["fault"] == "wrong":
                    buf[numel // 2] += 1.0  # same wrong value on every rank
                elif rank == n - 1:  # "diverge": one rank 1 ulp off
                    buf[numel // 2] = torch.nextafter(buf[numel // 2], torch.tensor(math.inf))
            if rep >= warm:
                times[alg].append(t1 - t0)
            err = (buf.double() - ref).abs_().div_(bound).max().item() if numel else 0.0
            errors[alg].append(err if math.isfinite(err) else float("inf"))
            digests[alg].append(hashlib.blake2b(buf.numpy().tobytes(), digest_size=16).hexdigest())
    everyone = all_gather_json({"times": times, "digests": digests, "errors": errors})
    return [check(alg, plan[alg][1], everyone, reps) for alg in plan]


def check(alg: str, chunks: int, everyone: list[dict], reps: int) -> dict:
    """One algorithm's row: every rank's times and checks of one size, gathered."""
    per_rank = [e["times"][alg] for e in everyone]
    worst = max(max(e["errors"][alg]) for e in everyone)
    mismatched = [rep for rep in range(reps) if len({e["digests"][alg][rep] for e in everyone}) != 1]
    problems = []
    if worst > 1.0:
        bad = [(r, rep) for r, e in enumerate(everyone) for rep, v in enumerate(e["errors"][alg]) if v > 1.0]
        problems.append(
            f"wrong sum: error up to {worst:.3g}x the float32 rounding bound "
            f"(rank, repetition incl. warm-up: {bad[:6]})"
        )
    if mismatched:
        problems.append(f"ranks disagree bit-wise in repetitions {mismatched[:6]} (incl. warm-up)")
    return {
        "algorithm": alg,
        "chunks": chunks or None,
        "times_s": [max(ts) for ts in zip(*per_rank)],  # slowest rank, per repetition
        "rank_median_s": [statistics.median(ts) for ts in per_rank],
        "max_error_over_bound": worst,
        "bit_identical": not mismatched,
        "correct": not problems,
        "problems": problems,
    }
