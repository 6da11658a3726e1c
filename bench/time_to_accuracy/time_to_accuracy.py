#!/usr/bin/env python3
"""Time-to-accuracy benchmark (issues #13, #24): training wall seconds to 99% test accuracy, ours vs
DDP and torch's local SGD, over one or several link rates.

Every configuration (--configs: ours[+C], ours[+C]@H, ddp[+C], localsgd@H) trains the full recipe
from scratch in a world of its own; the clock counts training only, stopped at each evaluation point.

    sudo python3 bench/time_to_accuracy/time_to_accuracy.py  # 200mbit, N = 2 and 4, 2 epochs
    python3 bench/time_to_accuracy/time_to_accuracy.py --loopback --world-sizes 2 --epochs 1 --train-subset 6400

The configurations, the clock, --repeats and --rates: bench/time_to_accuracy/NOTES.md ("Time to accuracy",
"Command-line details"). Results: bench/results/time_to_accuracy/time_to_accuracy-<mode>[-<what differs>].{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # bench/common: harness, stats (run directly)
import harness
import stats
import time_to_accuracy_report as report
from harness import run_driver
from peers import DDP_HOOKS
from peers import parse_ours as parse_sync
from targets import bound
from time_to_accuracy_worker import worker

from utils.comm.compress import DEFAULT_POWERSGD_RANK, DEFAULT_POWERSGD_WARMUP
from utils.comm.names import DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, OUTERS
from utils.setup.values import momentum_value

DEFAULTS = {
    "rate": "200mbit",
    "world_sizes": [2, 4],
    "epochs": 2,
    "evals_per_epoch": 16,
    "target": bound("accuracy"),
    "global_batch": 64,
    "lr": 4e-3,
    "seed": 1,
    "ours": "ring+overlap+lazy",
    "configs": ["ours", "ours+bf16", "ours+powersgd", "ddp", "ddp+fp16", "ddp+powersgd"],
    "repeats": 1,
    "powersgd_rank": DEFAULT_POWERSGD_RANK,
    "powersgd_warmup": DEFAULT_POWERSGD_WARMUP,
    "outer": "average",
    "outer_lr": DEFAULT_OUTER_LR,
    "outer_momentum": DEFAULT_OUTER_MOMENTUM,
    "localsgd_warmup": 50,
}  # the baseline: 50 synchronous steps before local SGD
MODEL_NUMEL = harness.MODEL_NUMEL
KINDS = ("ours", "ddp", "localsgd")
PERIODIC_COMPRESS = ("bf16", "fp16")  # what ours@H may send the change as (besides float32)


# --------------------------------------------------------------------------- configurations
def parse_config(name: str) -> dict:
    """'ours', 'ours+bf16', 'ours+bf16@16', 'ours+fp16@64:32', 'ddp+powersgd', 'localsgd@16', ... -> {"name",
    "kind", "compress", "sync_every"[, "merge_after"]}; ValueError (saying what is wrong) otherwise."""
    base, at, period = name.partition("@")
    period, colon, merge = period.partition(":")  # ours@H:T: --merge-after T (default: train.py's)
    kind, plus, compress = base.partition("+")
    if kind not in KINDS or (plus and compress not in DDP_HOOKS):
        raise ValueError(
            f"unknown configuration {name!r}: ours[+C][@H], ddp[+C] or localsgd@H, C one of {', '.join(DDP_HOOKS)}"
        )
    if at and not (period.isascii() and period.isdigit()):
        raise ValueError(f"configuration {name!r}: @H is a whole number of steps, got {period!r}")
    every = int(period) if at else 1
    if kind == "ddp" and at:
        raise ValueError(f"configuration {name!r}: DDP sums every step (torch's periodic averaging is localsgd@H)")
    if kind == "localsgd" and (plus or every < 2):
        raise ValueError(f"configuration {name!r}: localsgd@H needs a period H >= 2 and sends float32 (no +C)")
    if kind == "ours" and at and every < 2:
        raise ValueError(f"configuration {name!r}: @H needs H >= 2 (H = 1 is plain {base!r})")
    if kind == "ours" and every > 1 and compress not in ("", *PERIODIC_COMPRESS):
        raise ValueError(
            f"configuration {name!r}: with @H the change goes as float32, "
            f"+{' or +'.join(PERIODIC_COMPRESS)} (train.py refuses {compress} with --sync-every)"
        )
    if colon and not (
        kind == "ours" and every > 1 and merge.isascii() and merge.isdigit() and 1 <= int(merge) <= every
    ):
        raise ValueError(f"configuration {name!r}: ours@H:T merges T steps after a round's end, 1 <= T <= H")
    spec = {"name": name, "kind": kind, "compress": compress or "none", "sync_every": every}
    return spec | ({"merge_after": int(merge)} if colon else {})


def parse_ours(text: str) -> dict:
    """--ours: '<algorithm>[+overlap[+lazy]]' -> our sync's settings; ValueError otherwise."""
    try:
        return parse_sync(text)
    except ValueError as e:
        raise ValueError(f"--ours: {e}") from None


def results_stem(args, mode: str) -> str:
    """time_to_accuracy-<mode>, plus whatever this run changed from the default plan, so that a quick or
    partial run never overwrites the full one (e.g. time_to_accuracy-loopback-n2-e1-sub6400)."""
    lr, momentum = outer_settings(args)
    named = dict(world_sizes=lambda v: "n" + "+".join(map(str, v)), epochs="e{}", evals_per_epoch="ev{}")
    named |= dict(train_subset="sub{}", test_subset="test{}", global_batch="gb{}", seed="seed{}", ours="{}")
    rates = "+".join(args.rates) if mode == "cluster" and args.rates != [DEFAULTS["rate"]] else None
    parts = [f"time_to_accuracy-{mode}", rates]
    parts += harness.differences(args, DEFAULTS, named)
    psgd = (args.powersgd_rank, args.powersgd_warmup)
    parts.append(f"r{psgd[0]}w{psgd[1]}" if psgd != (DEFAULTS["powersgd_rank"], DEFAULTS["powersgd_warmup"]) else None)
    parts += harness.differences(args, DEFAULTS, {"outer": "{}"})
    parts += [f"olr{lr:g}" if lr not in (None, DEFAULTS["outer_lr"]) else None]
    parts += [f"om{momentum:g}" if momentum not in (None, DEFAULTS["outer_momentum"]) else None]
    parts += harness.differences(args, DEFAULTS, {"localsgd_warmup": "lw{}"})
    parts += ["subset" if sorted(args.configs) != sorted(DEFAULTS["configs"]) else None]
    return harness.results_stem(*parts, *harness.differences(args, DEFAULTS, {"repeats": "x{}"}))


def outer_settings(args) -> tuple:
    """(outer_lr, outer_momentum) of ours@H as train.py resolves them: None unless --outer nesterov."""
    if args.outer != "nesterov":
        return None, None
    lr, momentum = args.outer_lr, args.outer_momentum
    return DEFAULTS["outer_lr"] if lr is None else lr, DEFAULTS["outer_momentum"] if momentum is None else momentum


# --------------------------------------------------------------------------- driver
def estimate_seconds(n: int, rate: str | None, steps: int, evals: int) -> float:
    """Rough, generous time of one world (start-up, compute-only timing, training, evaluations), for the
    hard timeout."""
    compute = 0.03 * max(1.0, n / (os.cpu_count() or 1))  # 64 images over N ranks
    comm = harness.sum_seconds(n, harness.parse_rate(rate) if rate else None, MODEL_NUMEL)
    return 60 + steps * (compute + comm) + 5 * evals


def run_all(args, specs: list[dict], rate: str | None, est: dict, done=lambda records: None) -> list[dict]:
    """Every configuration in every world size at one link rate, one world at a time (one emulated
    cluster for all); done(records so far) after each world."""
    records, link = [], rate or "loopback"
    cfg = harness.pick(args, "seed epochs lr global_batch train_subset test_subset evals_per_epoch compute_steps")
    cfg |= harness.pick(args, "powersgd_rank powersgd_warmup outer localsgd_warmup eval_cache")
    cfg |= dict(zip(("outer_lr", "outer_momentum"), outer_settings(args)), ours=parse_ours(args.ours), label=link)
    with harness.worlds_dir("time-to-accuracy-") as tmp, harness.emulated_cluster(rate, max(args.world_sizes)) as cl:
        worlds = [(n, run, spec) for n in args.world_sizes for run in range(1, args.repeats + 1) for spec in specs]
        for k, (n, run, spec) in enumerate(worlds, 1):  # round-robin: run r of every configuration, then r+1
            timeout, t = args.timeout or (120 + 2 * est[n]), time.time()
            what = f"{link} N={n} {spec['name']}" + (f" run {run}" if args.repeats > 1 else "")
            tag = f"n{n}-{spec['name'].replace('+', '-')}-{run}"
            world = cfg | harness.world_config(cl, 29700, k, n) | {"spec": spec}
            raw = harness.launch_world(WORKER, world, cl, tmp, tag, timeout, what)
            rec = report.summarize(raw, spec, n, args.target, args.epochs) | {"rate": rate}
            if spec["kind"] == "ours" and spec["sync_every"] > 1:
                rec["outer"] = args.outer
            if args.repeats > 1:
                rec["run"] = run
            records.append(rec | {"load": raw["load"]})
            done(records)
            reached = stats.fmt(rec["time_to_target_s"], "{:.1f} s", "not reached")
            trained = f"{rec['train_seconds']:.0f} s training, final {rec['final_accuracy']:.2%}"
            took = f"({time.time() - t:.0f}s, hard timeout {timeout:.0f}s)"
            print(
                f"  {link} N={n} {report.label(rec, args.ours)}: {reached} to {args.target:.1%}, {trained} {took}",
                flush=True,
            )
    return records


def write_results_so_far(args, records, mode, rates, command, notes, started, complete=True):
    """The JSON, markdown and PNG of `records`; a run still going (complete=False) says so in both."""
    host = harness.host_info()
    md, tbl, title = report.markdown(records, args, rates, host, command, notes, complete)
    result = dict(mode=mode, rate=rates[0] if len(rates) == 1 else None, rates=rates, world_sizes=args.world_sizes)
    result |= dict(command=command, notes=notes, complete=complete)
    result |= harness.pick(args, "epochs evals_per_epoch target global_batch train_subset test_subset lr seed ours")
    result |= harness.pick(args, "powersgd_rank powersgd_warmup outer")
    result |= dict(zip(("outer_lr", "outer_momentum"), outer_settings(args)))
    result |= harness.pick(args, "localsgd_warmup compute_steps configs repeats") | harness.run_info(host, started)
    # compute only sends nothing: the worlds of every link rate time the same thing
    free = {str(n): report.free_network([r for r in records if r["world_size"] == n]) for n in args.world_sizes}
    result["free_network"] = free
    result["results"] = records
    out = Path(args.results_dir) / results_stem(args, mode)
    harness.write_results(out, result, md, report.plot(records, title, args.world_sizes, args.ours, args.target, rates))
    return out, tbl


def driver(args) -> int:
    mode = "loopback" if args.loopback else "cluster"
    rates = [None] if args.loopback else args.rates
    specs = [parse_config(c) for c in args.configs]
    subset = args.train_subset or 60000
    steps = {n: args.epochs * ((subset // n) // max(1, args.global_batch // n)) for n in args.world_sizes}
    evals = args.epochs * args.evals_per_epoch + 1
    est = {rate: {n: estimate_seconds(n, rate, steps[n], evals) for n in args.world_sizes} for rate in rates}
    command = harness.command_line("time_to_accuracy/time_to_accuracy.py")
    notes = report.plan_notes(args, specs, *outer_settings(args))
    link = f"egress cap per host {', then '.join(rates)}" if rates != [None] else "127.0.0.1, no cap"
    rounds = f", {args.repeats} rounds" if args.repeats > 1 else ""
    plan = f"configurations {', '.join(args.configs)} (each in its own world, one after the other{rounds})"
    print(f"# time-to-accuracy benchmark: mode={mode}, {link}, N={','.join(map(str, args.world_sizes))}; {plan}")
    print(f"# {notes}")
    worlds = len(specs) * args.repeats
    each = [f"{rate or 'loopback'} N={n} ~{worlds * s:.0f}s" for rate in rates for n, s in est[rate].items()]
    print("# estimate (generous) " + ", ".join(each), flush=True)
    started = time.time()
    total = len(specs) * len(args.world_sizes) * args.repeats * len(rates)
    records = []

    def save(so_far):
        """Write the results so far (atomically): a failed or interrupted run keeps its finished worlds."""
        return write_results_so_far(args, so_far, mode, rates, command, notes, started, complete=len(so_far) == total)

    for rate in rates:  # one emulated cluster per rate, one after the other
        records = records + run_all(args, specs, rate, est[rate], done=lambda recs, before=records: save(before + recs))
    out, tbl = save(records)
    print(f"\n{tbl}\n")
    print(f"wrote {out}.json, .md, .png  ({time.time() - started:.0f}s)")
    bad = [f"{r['rate'] or 'loopback'} N={r['world_size']} {r['config']}" for r in records if not r["params_identical"]]
    if bad:
        print("time_to_accuracy.py: ranks ended with DIFFERENT parameters in: " + ", ".join(bad), file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    def fraction(text):
        v = harness.positive(float)(text)
        if v > 1:
            raise argparse.ArgumentTypeError(f"--target is a fraction of the test set (e.g. 0.99), got {text}")
        return v

    d, positive = DEFAULTS, harness.positive
    ap = harness.bench_parser(__doc__)
    harness.add_link_options(ap, d["rate"], one_rate=True)
    harness.add_options(ap, powersgd=True)
    configs = "ours[+C][@H], ddp[+C], localsgd@H; C fp16, bf16 or powersgd (with @H: fp16 or bf16)"
    ap.add_argument("--configs", default=",".join(d["configs"]), type=lambda s: s.split(","), help=configs)
    ap.add_argument("--ours", default=d["ours"], help="our configuration, <algorithm>[+overlap[+lazy]]")
    ap.add_argument("--epochs", type=positive(int), default=d["epochs"])
    ap.add_argument("--evals-per-epoch", type=positive(int), default=d["evals_per_epoch"], help="evaluation points")
    ap.add_argument("--target", type=fraction, default=d["target"], help="test accuracy (bench/common/targets.py)")
    ap.add_argument("--train-subset", type=positive(int), help="train on only the first N training images")
    ap.add_argument("--test-subset", type=positive(int), help="evaluate on only the first N test images")
    ap.add_argument("--global-batch", type=positive(int), default=d["global_batch"], help="images per step, all ranks")
    ap.add_argument("--lr", type=positive(float), default=d["lr"])
    ap.add_argument("--outer", choices=OUTERS, default=d["outer"], help="ours@H's outer step (nesterov: DiLoCo's)")
    ap.add_argument("--outer-lr", type=positive(float), help=f"with --outer nesterov (default {d['outer_lr']:g})")
    nesterov = f"with --outer nesterov (default {d['outer_momentum']:g})"
    ap.add_argument("--outer-momentum", type=momentum_value, help=nesterov)
    first = "localsgd@H: DDP steps first"
    ap.add_argument("--localsgd-warmup", type=harness.at_least(0), default=d["localsgd_warmup"], help=first)
    rounds = "train each this many times, round-robin"
    ap.add_argument("--repeats", type=positive(int), default=d["repeats"], help=rounds)
    ap.add_argument("--compute-steps", type=positive(int), default=40, help="compute-only steps timed per world")
    ap.add_argument("--eval-cache", metavar="PATH", help="keep test accuracies by model sha256 in this JSON file")
    harness.add_world_options(ap, "time_to_accuracy")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    harness.check_options(ap, args)
    try:
        specs = [parse_config(c) for c in args.configs]
        parse_ours(args.ours)
    except ValueError as e:
        ap.error(str(e))
    sizes, batch, train = args.world_sizes, args.global_batch, args.train_subset
    if len(set(args.configs)) != len(args.configs):
        ap.error("--configs: a configuration named twice")
    if (args.outer_lr, args.outer_momentum) != (None, None) and args.outer != "nesterov":
        ap.error("--outer-lr and --outer-momentum are for --outer nesterov")
    if args.outer != d["outer"] and not any(s["kind"] == "ours" and s["sync_every"] > 1 for s in specs):
        ap.error(f"--outer {args.outer} is for ours@H configurations, and --configs has none")
    if any(batch // n < 1 for n in sizes):
        ap.error(f"--global-batch {batch} leaves no image per rank at N={max(sizes)}")
    if train and any(train // n < batch // n for n in sizes):
        ap.error(f"--train-subset {train} is less than one step of {batch} images")
    if train and train > 60000:
        ap.error("--train-subset: MNIST has 60000 training images")
    if args.test_subset and args.test_subset > 10000:
        ap.error("--test-subset: MNIST has 10000 test images")
    return run_driver(driver, args, "time_to_accuracy.py")


WORKER = str(Path(__file__).resolve())

if __name__ == "__main__":
    sys.exit(main())
