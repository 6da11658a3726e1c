"""bench/allreduce.py's ranks: every algorithm's sum of one buffer per size, interleaved, timed, and
checked against a float64 reference and for bit-identical results on every rank.

The kernels are called directly (utils/comm/ring.py's functions, a utils.comm.hierarchical.Hierarchy made
up front), or another copy of ring.py (--ring-file) and candidates' ring_sum (--candidate).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import statistics
import time
from pathlib import Path

from harness import rotated, start_worker

from utils.files import write_file

ELEMENT = 4  # bytes per float32


def worker(args) -> int:
    cfg = json.loads(Path(args.config).read_text())
    rank, n = args.rank, cfg["world_size"]

    import torch
    import torch.distributed as dist

    if cfg["ring_file"]:  # benchmark another copy of ring.py (e.g. a proposed patch)
        spec = importlib.util.spec_from_file_location("ring_under_test", cfg["ring_file"])
        ring = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ring)
    else:
        from utils.comm import ring
    candidates = {}  # "ring:<stem>": another ring_sum, measured interleaved
    for path in cfg["candidates"]:
        spec = importlib.util.spec_from_file_location(f"candidate_{len(candidates)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        candidates[f"ring:{Path(path).stem}"] = module.ring_sum

    say = start_worker(cfg, rank, deterministic=False)
    import datetime

    from utils.comm import hierarchical

    hosts = hierarchical.discover()
    # its subgroups, made up front by every rank (made at its first sum, they would be timed)
    hierarchy = (
        hierarchical.Hierarchy(hosts, datetime.timedelta(seconds=cfg["op_timeout"]))
        if "hierarchical" in cfg["algorithms"]
        else None
    )
    say(
        f"  N={n}: {n} ranks up, {hierarchical.describe(hosts)} ({cfg['init_method']}, GLOO_SOCKET_IFNAME="
        f"{os.environ.get('GLOO_SOCKET_IFNAME', '-')}, torch {torch.__version__})"
    )
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
        bound = abs_sum.mul_((n - 1) * 2.0**-24).add_(1e-30)  # worst-case float32 rounding
        del inputs, abs_sum
        buf = torch.empty_like(mine)
        plan = {
            alg: (
                1
                if alg == "two-pass"
                else (cfg["chunks"] or ring.auto_chunks(numel))
                if alg == "two-pass-pipelined"
                else 0
            )
            for alg in cfg["algorithms"] + list(candidates)
        }
        times = {alg: [] for alg in plan}  # this rank's t1 - t0, timed repetitions
        digests = {alg: [] for alg in plan}  # per repetition (warm-up included)
        errors = {alg: [] for alg in plan}  # max |err| / bound per repetition
        algs = list(plan)
        for rep in range(reps_warm + reps_timed):
            for alg in rotated(algs, rep):
                buf.copy_(mine)
                dist.barrier()
                t0 = time.perf_counter()
                run(alg, buf, plan[alg])
                t1 = time.perf_counter()
                if cfg["fault"] and alg == "ring":  # self-test of the checks below
                    if cfg["fault"] == "wrong":
                        buf[numel // 2] += 1.0  # same wrong value on every rank
                    elif rank == n - 1:  # "diverge": one rank 1 ulp off
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
            t_max = [max(ts) for ts in zip(*per_rank)]  # slowest rank, per repetition
            worst_err = max(max(e["errors"][alg]) for e in everyone)
            mismatched = [
                rep for rep in range(reps_warm + reps_timed) if len({e["digests"][alg][rep] for e in everyone}) != 1
            ]
            problems = []
            if worst_err > 1.0:
                bad = [(r, rep) for r, e in enumerate(everyone) for rep, v in enumerate(e["errors"][alg]) if v > 1.0]
                problems.append(
                    f"wrong sum: error up to {worst_err:.3g}x the float32 rounding bound "
                    f"(rank, repetition incl. warm-up: {bad[:6]})"
                )
            if mismatched:
                problems.append(f"ranks disagree bit-wise in repetitions {mismatched[:6]} (incl. warm-up)")
            for p in problems:
                failures.append(f"N={n} size={size['label']} algorithm={alg}: {p}")
            rows.append(
                {
                    "algorithm": alg,
                    "chunks": plan[alg] or None,
                    "times_s": t_max,
                    "rank_median_s": [statistics.median(ts) for ts in per_rank],
                    "max_error_over_bound": worst_err,
                    "bit_identical": not mismatched,
                    "correct": not problems,
                    "problems": problems,
                }
            )
        out["sizes"].append({**size, "numel": numel, "rows": rows})
        say(
            f"  N={n} {size['label']:>6} ({reps_timed} iters): "
            + "  ".join(
                f"{r['algorithm']} {statistics.median(r['times_s']) * 1e3:.2f}ms" + ("" if r["correct"] else " WRONG")
                for r in rows
            )
        )
        del ref, bound, buf

    out["failures"] = failures
    if rank == 0:
        write_file(Path(cfg["out"]), json.dumps(out).encode())
    dist.barrier()
    dist.destroy_process_group()
    return 3 if failures else 0
