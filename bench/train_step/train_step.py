#!/usr/bin/env python3
"""Training-step benchmark: how close the trainer's gradient sums get to compute-only, and to DDP.

Times utils.run.train_step (forward, backward, the gradient sync, Adam) under the floors
(compute-alone, compute, compute+sync, compute+wire), each of our algorithms plain, +overlap and
+overlap+lazy, and DDP, interleaved round by round; --compression adds compressed rows beside DDP's hooks.

    python3 bench/train_step/train_step.py             # emulated cluster, --rates 1gbit,200mbit, N = 2 and 4
    python3 bench/train_step/train_step.py --loopback  # 127.0.0.1, no cap

The configurations, the clock, the columns and the targets: bench/train_step/NOTES.md ("Training step",
"Command-line details"). Results: bench/results/train_step/train_step-<mode>[-<what differs>].{json,md,png}.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # bench/common: harness, stats (run directly)
import harness
import stats
import train_step_report as report
from harness import run_driver
from peers import ALGORITHMS, DDP_HOOKS, parse_ours
from train_step_worker import make_model, worker

from utils.comm.compress import DEFAULT_POWERSGD_RANK, DEFAULT_POWERSGD_WARMUP

# The default plan; results_stem() names the files after whatever a run changed from it.
DEFAULTS = {"rates": ["1gbit", "200mbit"], "world_sizes": [2, 4], "model": "trainer", "batch_size": 32}
DEFAULTS["algorithms"], DEFAULTS["compression"] = ["two-pass", "ring", "gloo"], False
# --compression (issue #13): which compressions, on which of our configurations, PowerSGD's settings
DEFAULTS |= {"compress": list(DDP_HOOKS), "compress_with": ["ring+overlap+lazy"]}
DEFAULTS |= {"powersgd_rank": DEFAULT_POWERSGD_RANK, "powersgd_warmup": DEFAULT_POWERSGD_WARMUP}
MODEL_NUMEL = {"trainer": harness.MODEL_NUMEL, "reference": harness.numel(make_model("reference"))}  # counted
FLOORS = ("compute-alone", "compute", "compute+sync", "compute+wire")
TIMING = (
    "per round every configuration once (order rotated); per step: barrier, t0, step, t1 on every "
    "rank; step time = max over ranks; median over timed rounds"
)
COMPUTE_BASELINES = (
    "compute = all N ranks compute at once, no communication (fair on a shared machine); "
    "compute-alone = rank 0 alone, the other ranks idle"
)


# --------------------------------------------------------------------------- configurations
def batch_for(args, n: int) -> int:
    """Images per step per rank in a world of n ranks."""
    return max(1, args.global_batch // n) if args.global_batch else args.batch_size


def make_configs(args) -> list[dict]:
    """The configurations, in the order they are listed (the run rotates the order per round)."""
    # "auto": as train.py resolves it, by the bytes and the hosts (utils.comm.ring.auto_chunks)
    plain_chunks = bucket_chunks = "auto" if args.chunks == "auto" else int(args.chunks)
    kinds = ("compute", "compute", "sync", "wire")
    configs = [{"name": name, "kind": kind, "alone": name == "compute-alone"} for name, kind in zip(FLOORS, kinds)]
    for alg in args.algorithms:
        two_pass = alg == "two-pass"
        plain = {"name": alg, "kind": "sum", "allreduce": alg, "overlap": False}
        configs.append(dict(plain, chunks=plain_chunks if two_pass else None, bucket_mb=None))
        for mb in args.bucket_mb:
            for lazy in (False, True):
                name = f"{alg}+overlap{'+lazy' if lazy else ''}" + ("" if len(args.bucket_mb) == 1 else f"@{mb:g}MB")
                overlap = {"name": name, "kind": "sum", "allreduce": alg, "overlap": True, "lazy": lazy}
                configs.append(dict(overlap, chunks=bucket_chunks if two_pass else None, bucket_mb=mb))
    configs.append({"name": "ddp", "kind": "ddp"})
    if args.only:
        configs = [c for c in configs if c["name"] in {*args.only, *FLOORS, "ddp"}]
    if args.compression:  # always kept by --only
        configs += compression_configs(args, plain_chunks, bucket_chunks)
    if args.timeline:  # issue #15: each of ours again, recording a timeline
        configs += [dict(c, name=f"{c['name']}+timeline", timeline=True) for c in configs if c["kind"] == "sum"]
    return configs


def parse_sum_config(name: str) -> dict:
    """One of our uncompressed configuration names ("ring+overlap+lazy") -> its settings
    {allreduce, overlap, lazy}; ValueError if it is none."""
    ours = parse_ours(name)
    return {"allreduce": ours["allreduce"], "overlap": ours["overlap"], "lazy": ours["lazy_update"]}


def compression_configs(args, plain_chunks, bucket_chunks) -> list[dict]:
    """Issue #13's rows (--compression): each --compress on each of our --compress-with configurations
    (our Sync with compress=...), then DDP with torch's matching comm hook."""
    out = []
    for base in args.compress_with:
        spec = parse_sum_config(base)
        chunks = (bucket_chunks if spec["overlap"] else plain_chunks) if spec["allreduce"] == "two-pass" else None
        mb = args.bucket_mb[0] if spec["overlap"] else None
        out += [
            dict(name=f"{base}+{c}", kind="sum", **spec, compress=c, chunks=chunks, bucket_mb=mb) for c in args.compress
        ]
    return out + [{"name": f"ddp+{c}", "kind": "ddp", "hook": c} for c in args.compress]


# --------------------------------------------------------------------------- driver
def estimate_seconds(args, n: int, rate_bits: float | None, configs: list[dict]) -> float:
    """Rough, generous run time of a world of n ranks (start-up + the steps of every configuration), for the
    hard timeout."""
    steps, batch, model = (args.warmup + args.iters) * args.steps_per_sample, batch_for(args, n), args.model
    heavier = MODEL_NUMEL[model] / MODEL_NUMEL["trainer"]  # the reference model: ~3x of both
    compute = 0.03 * batch / 32 * max(1.0, n / (os.cpu_count() or 1)) * heavier  # ~16-20 ms/step alone, measured
    comm = harness.sum_seconds(n, rate_bits, MODEL_NUMEL[model])
    return 30 + steps * sum(compute + (comm if c["kind"] != "compute" else 0.0) for c in configs)


def run_worlds(args, configs: list[dict], rates: list, rate_bits: dict, est: dict) -> tuple[list, dict]:
    """Every world size at every rate (one emulated cluster per rate): (records, load per world)."""
    records, load, k = [], {}, args.ranks_per_host
    cfg = harness.pick(args, "seed model warmup iters steps_per_sample powersgd_rank powersgd_warmup")
    with harness.worlds_dir("train-step-bench-") as tmp:
        for rate in rates:
            label = rate or "loopback"
            with harness.emulated_cluster(rate, max(args.world_sizes), k) as cl:
                for i, n in enumerate(args.world_sizes):
                    timeout, t, ranks = args.timeout or (120 + 2 * est[(rate, n)]), time.time(), n * k
                    world = harness.world_config(cl, 29600, i, ranks)  # --ranks-per-host K: N hosts, N·K ranks
                    world["addrs"] = [cl.addr(cl.host_of(r)) if cl else "127.0.0.1" for r in range(ranks)]
                    world |= {"batch_size": batch_for(args, ranks), "configs": configs, "label": label}
                    tag = f"{re.sub(r'[^A-Za-z0-9]+', '-', label)}-n{ranks}"
                    what = f"{label} N={ranks}"
                    raw = harness.launch_world(WORKER, cfg | world, cl, tmp, tag, timeout, what, per_host=k)
                    print(f"  {label} N={n}: done in {time.time() - t:.0f}s (hard timeout {timeout:.0f}s)", flush=True)
                    records += report.summarize(raw, rate, rate_bits.get(rate), batch_for(args, ranks))
                    load[f"{label} N={n}"] = raw["load"]
    return records, load


def driver(args) -> int:
    mode, rates = ("loopback", [None]) if args.loopback else ("cluster", args.rates)
    k, worlds, cores = args.ranks_per_host, args.world_sizes, os.cpu_count()
    configs = make_configs(args)
    per_world = ", ".join(f"{batch_for(args, n * k)}/rank at N={n * k}" for n in worlds)
    gb = args.global_batch
    batch_note = f"global batch {gb} = {per_world}" if gb else f"batch {args.batch_size} per rank"
    rate_bits = {r: harness.parse_rate(r) for r in rates if r}
    est = {(r, n): estimate_seconds(args, n * k, rate_bits.get(r), configs) for r in rates for n in worlds}
    if args.model != "trainer":
        batch_note = f"{args.model} model ({MODEL_NUMEL[args.model]:,} parameters), {batch_note}"
    notes = (
        f"{batch_note}; {args.warmup} warm-up + {args.iters} timed rounds of {args.steps_per_sample} consecutive "
        f"steps per configuration, configurations interleaved; ms/step = round time / steps, max over "
        f"ranks, median over rounds. 'compute' = all N ranks computing at once without communication "
        f"(fair baseline on {cores} cores); 'compute-alone' = rank 0 alone. "
        f"x compute = ms/step / compute's. fwd+bwd, sum/wait, opt: medians of the step's parts (max over ranks); "
        f"cpu/rank: CPU ms per step of a rank (all threads; kernel part in brackets)."
    )
    link = f"egress cap per host {', '.join(rates)}" if not args.loopback else "127.0.0.1, no cap"
    sizes = ",".join(map(str, worlds))
    print(
        f"# training-step benchmark: mode={mode}, {link}, N={sizes}, 1 torch thread per rank, {cores} CPU cores", end=""
    )
    print(" on this machine")
    print(f"# configurations: {', '.join(c['name'] for c in configs)} (order rotated per round)")
    print(f"# {notes}")
    estimate = ", ".join(f"{r or 'loopback'} N={n} ~{s:.0f}s" for (r, n), s in est.items())
    print(f"# load average now {stats.loadavg():.2f}; estimate {estimate}", flush=True)

    started = time.time()
    records, load = run_worlds(args, configs, rates, rate_bits, est)
    differ = (r for r in records if r["params_identical"] is False)
    not_identical = [f"{r['rate'] or 'loopback'} N={r['world_size']} {r['config']}" for r in differ]
    targets, host = report.evaluate_targets(records, mode, rates, worlds), harness.host_info()
    model_note = "" if args.model == "trainer" else f"{args.model} model, "
    title = f"training step, {mode}; {model_note}batch {args.batch_size}/rank, 1 thread/rank, {cores} cores; "
    title += f"{host['node']}, torch {host['torch']}"
    command = harness.command_line("train_step/train_step.py")
    loadavg = {w: f"loadavg {v['loadavg_before']:.2f}->{v['loadavg_after']:.2f}" for w, v in load.items()}
    load_line = "; ".join(
        f"{w}: other processes {v['foreign_cpu_cores']:.2f} cores, {loadavg[w]}" for w, v in load.items()
    )
    md = f"### Training-step benchmark, {mode}\n\n`{command}`  \n{notes}  \nLoad: {load_line}\n\n"
    md += f"{report.table(records, mode)}\n\n```\n{report.target_lines(targets)}\n```\n"
    result = {"mode": mode, "rates": rates, "world_sizes": worlds, "command": command}
    result["batch_size"] = {str(n * k): batch_for(args, n * k) for n in worlds}
    result |= {"global_batch": args.global_batch, "ranks_per_host": k}
    result |= harness.pick(args, "warmup iters steps_per_sample seed model")
    result |= {"model_parameters": MODEL_NUMEL[args.model], "threads_per_rank": 1, "chunks": args.chunks}
    result |= {"bucket_mb": args.bucket_mb, "configs": configs}
    result |= {"timing": TIMING, "compute_baselines": COMPUTE_BASELINES}
    result |= harness.run_info(host, started) | {"load": load, "params_identical": not not_identical}
    result |= {"not_identical": not_identical, "targets": targets, "results": records}
    out = Path(args.results_dir) / results_stem(args, mode)
    harness.write_results(out, result, md, report.plot(records, title, rates, worlds))

    print(f"\n{report.table(records, mode)}\n\nLoad during the runs: {load_line}\n")
    print(f"Targets{'' if mode == 'cluster' else ' (defined for the capped cluster; loopback ratios are info)'}:")
    print(report.target_lines(targets))
    print(f"\nwrote {out}.json, .md, .png  ({time.time() - started:.0f}s)")
    if not_identical:
        print("\ntrain_step.py: ranks ended with DIFFERENT parameters in: " + ", ".join(not_identical), file=sys.stderr)
        return 1
    return 0


def results_stem(args, mode: str) -> str:
    """The results files' name: train_step-<mode>, plus whatever this run did differently from the
    default plan (rates, world sizes, model, batch, a subset of configurations), so that a partial
    or different run never overwrites the full one (train_step-cluster-1gbit-n2-b64.*)."""
    d, psgd = DEFAULTS, (args.powersgd_rank, args.powersgd_warmup)
    parts = [f"train_step-{mode}", "+".join(args.rates) if mode == "cluster" and args.rates != d["rates"] else None]
    parts += harness.differences(args, d, {"world_sizes": lambda v: "n" + "+".join(map(str, v)), "model": "{}"})
    batch = harness.differences(args, d, {"batch_size": "b{}"})[0]
    parts += [f"gb{args.global_batch}" if args.global_batch else batch]
    parts += ["subset" if args.only or args.algorithms != d["algorithms"] else None]
    parts += [f"{args.ranks_per_host}-per-host" if args.ranks_per_host > 1 else None]
    parts += ["timeline" if args.timeline else None]
    if args.compression:
        with_ = "+".join(c.replace("+overlap", "-ov").replace("+lazy", "-lazy") for c in args.compress_with)
        parts += ["compression", *harness.differences(args, d, {"compress": "+".join})]
        parts += ["with-" + with_ if args.compress_with != d["compress_with"] else None]
        changed = "powersgd" in args.compress and psgd != (d["powersgd_rank"], d["powersgd_warmup"])
        parts += [f"r{psgd[0]}w{psgd[1]}" if changed else None]
    return harness.results_stem(*parts)


def main(argv=None) -> int:
    def chunks(text):
        if text != "auto" and not (text.isdigit() and int(text) >= 1):
            raise argparse.ArgumentTypeError(f"--chunks: 'auto' or a whole number >= 1, got {text!r}")
        return text

    ap, d, positive = harness.bench_parser(__doc__), DEFAULTS, harness.positive
    harness.add_link_options(ap, ",".join(d["rates"]))
    harness.add_options(ap, warmup=3, iters=15, algorithms=(ALGORITHMS, ",".join(d["algorithms"])), powersgd=True)
    ap.add_argument("--batch-size", type=positive(int), default=d["batch_size"], help="images per step per rank")
    ap.add_argument("--global-batch", type=positive(int), help="images per step over all ranks instead (// N a rank)")
    sample = "consecutive training steps per configuration and round, timed together (default 6; "
    sample += "each sample starts after a barrier, which drains what a lazy update would carry over)"
    ap.add_argument("--steps-per-sample", type=positive(int), default=6, help=sample)
    ap.add_argument("--chunks", type=chunks, default="auto", help="two-pass pieces (default auto: auto_chunks)")
    ap.add_argument("--bucket-mb", default="1", type=harness.number_list(float), help="overlap bucket size(s) in MB")
    ap.add_argument("--only", type=lambda s: s.split(","), help="only these configurations (and the floors and ddp)")
    ap.add_argument("--timeline", action="store_true", help="also run each of ours recording a timeline (issue #15)")
    ap.add_argument("--compression", action="store_true", help="issue #13: add compressed rows, ours and DDP's hooks")
    hooks = harness.name_list(DDP_HOOKS, "compression(s)")
    ap.add_argument("--compress", default=",".join(DEFAULTS["compress"]), type=hooks, help="with --compression: which")
    with_ = "with --compression: our configuration(s) that compress, <algorithm>[+overlap[+lazy]]"
    ap.add_argument("--compress-with", default=",".join(d["compress_with"]), type=lambda s: s.split(","), help=with_)
    ap.add_argument("--model", choices=sorted(MODEL_NUMEL), default=DEFAULTS["model"], help="reference: issue #6's CNN")
    harness.add_world_options(ap, "train_step")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    harness.check_options(ap, args)
    if any(not (mb > 0 and math.isfinite(mb)) for mb in args.bucket_mb):
        ap.error("--bucket-mb must be positive")
    for name in args.compress_with:
        try:
            parse_sum_config(name)
        except ValueError as e:
            ap.error(f"--compress-with: {e}")
    known = {c["name"] for c in make_configs(argparse.Namespace(**{**vars(args), "only": None}))}
    if args.only and set(args.only) - known:
        unknown = sorted(set(args.only) - known)
        ap.error(f"--only: unknown configuration(s) {unknown}; choose from {', '.join(sorted(known))}")
    return run_driver(driver, args, "train_step.py")


WORKER = str(Path(__file__).resolve())

if __name__ == "__main__":
    sys.exit(main())
