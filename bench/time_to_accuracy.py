#!/usr/bin/env python3
"""Time-to-accuracy benchmark (issue #13): training wall seconds to 99% test accuracy, ours vs DDP.

Every configuration trains the full recipe from scratch, in a world of its own, one after the
other: utils/model.Net (same seed), Adam + one-cycle (utils.run.make_optimizer) over --epochs,
a global batch of --global-batch images split over the N ranks as train.py does (64 // N per
rank), each epoch's data order from utils.run.batches_of_epoch, torch.set_num_threads(1) and
deterministic algorithms per rank. Configurations (--configs):

    ours[+C]      utils.run.GradientSum with the --ours configuration (default ring+overlap+lazy:
                  the ring, summed during backward, updates applied lazily in the next forward),
                  compress=C (none, bf16, fp16, powersgd), as `train.py --compress C` runs it
    ddp[+C]       torch DistributedDataParallel (gloo); +fp16 / +bf16: default_hooks'
                  fp16_compress_hook / bf16_compress_hook; +powersgd: powerSGD_hook with the same
                  rank and warm-up as ours (one DDP bucket: over gloo, two abort)

Clock. Training time only: at every evaluation point (--evals-per-epoch per epoch, and once
before the first step) each rank applies any pending (lazy) update, stops its clock, and the
segment's time is the MAX over ranks (a synchronous step is done when its slowest rank is).
Rank 0 then evaluates on the 10,000 test images while the others wait at a barrier; after a
barrier the clock runs again. "time to 99.0%" is the training seconds at the first evaluation
point at or above --target (so it is accurate to one evaluation interval).

"compute only x steps" is what a free network would give: before training, every world times
--compute-steps steps of forward+backward+Adam on a scratch copy of the model, all N ranks at
once and without communication (the fair baseline when N ranks share this machine's cores);
that step time (max over ranks) times the configuration's step count.

Configurations run one after the other, so a slower spell of the machine lands on one of them.
--repeats K trains each K times, round-robin (run 1 of every configuration, then run 2, ...), and
adds a table of medians with each DDP configuration's time to the target against our best's,
run by run.

    sudo python3 bench/time_to_accuracy.py                   # 200mbit, N = 2 and 4, 2 epochs
    python3 bench/time_to_accuracy.py --loopback --world-sizes 2 --epochs 1 --train-subset 6400
    sudo python3 bench/time_to_accuracy.py --world-sizes 2 --configs ours+powersgd,ddp+powersgd --repeats 3

Output: a markdown table (with the exact command), a PNG of test accuracy vs training seconds
(one line per configuration, a panel per N) and the JSON, written atomically as
bench/results/time_to_accuracy-<mode>[-<what differs from the default plan>].{json,md,png}.
Every world has a hard timeout; on any error or Ctrl-C all ranks are killed and the emulated
cluster is torn down.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import io
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
    DDP_HOOKS, REPO, RESULTS, cluster, descendants, fmt, foreign_cpu, free_port, gradient_bytes_sent, LaunchError,
    loadavg, make_ddp, nic_tx_bytes, number_list, OneLineParser, parse_rate, proc_table, run_driver, run_world)
from utils.checkpoint import write_file  # noqa: E402
from utils.compress import DEFAULT_POWERSGD_RANK, DEFAULT_POWERSGD_WARMUP  # noqa: E402

COMPRESSIONS = ("none",) + DDP_HOOKS           # none, fp16, bf16, powersgd
DEFAULTS = {"rate": "200mbit", "world_sizes": [2, 4], "epochs": 2, "evals_per_epoch": 4, "target": 0.99,
            "global_batch": 64, "lr": 4e-3, "seed": 1, "ours": "ring+overlap+lazy",
            "configs": ["ours", "ours+bf16", "ours+powersgd", "ddp", "ddp+fp16", "ddp+powersgd"], "repeats": 1,
            "powersgd_rank": DEFAULT_POWERSGD_RANK, "powersgd_warmup": DEFAULT_POWERSGD_WARMUP}
MODEL_NUMEL = 421642                           # utils/model.Net
ALGORITHMS = ("two-pass", "ring", "gloo")


# --------------------------------------------------------------------------- pure helpers
def parse_config(name: str) -> dict:
    """'ours', 'ours+bf16', 'ddp', 'ddp+powersgd', ... -> {"name", "kind", "compress"}; ValueError otherwise."""
    kind, plus, compress = name.partition("+")
    if kind not in ("ours", "ddp") or (plus and compress not in DDP_HOOKS):
        raise ValueError(f"unknown configuration {name!r}: ours or ddp, optionally +{'/+'.join(DDP_HOOKS)}")
    return {"name": name, "kind": kind, "compress": compress or "none"}


def parse_ours(text: str) -> dict:
    """--ours: '<algorithm>[+overlap[+lazy]]' -> GradientSum's settings; ValueError otherwise."""
    alg, *flags = text.split("+")
    if alg not in ALGORITHMS or flags not in ([], ["overlap"], ["overlap", "lazy"]):
        raise ValueError(f"--ours: expected <algorithm>[+overlap[+lazy]] with algorithm one of "
                         f"{', '.join(ALGORITHMS)}, got {text!r}")
    return {"allreduce": alg, "overlap": "overlap" in flags, "lazy_update": "lazy" in flags}


def eval_steps(steps_per_epoch: int, evals_per_epoch: int) -> list[int]:
    """The steps within an epoch (1-based) after which to evaluate: evenly spaced, the last one always
    the epoch's end, none twice."""
    k = max(1, min(evals_per_epoch, steps_per_epoch))
    return sorted({max(1, round(steps_per_epoch * i / k)) for i in range(1, k + 1)})


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


def results_stem(args, mode: str) -> str:
    """time_to_accuracy-<mode>, plus whatever this run changed from the default plan, so that a quick or
    partial run never overwrites the full one (e.g. time_to_accuracy-loopback-n2-e1-sub6400)."""
    parts = [f"time_to_accuracy-{mode}"]
    if mode == "cluster" and args.rate != DEFAULTS["rate"]:
        parts.append(args.rate)
    if args.world_sizes != DEFAULTS["world_sizes"]:
        parts.append("n" + "+".join(map(str, args.world_sizes)))
    if args.epochs != DEFAULTS["epochs"]:
        parts.append(f"e{args.epochs}")
    if args.evals_per_epoch != DEFAULTS["evals_per_epoch"]:
        parts.append(f"ev{args.evals_per_epoch}")
    if args.train_subset:
        parts.append(f"sub{args.train_subset}")
    if args.test_subset:
        parts.append(f"test{args.test_subset}")
    if args.global_batch != DEFAULTS["global_batch"]:
        parts.append(f"gb{args.global_batch}")
    if args.seed != DEFAULTS["seed"]:
        parts.append(f"seed{args.seed}")
    if args.ours != DEFAULTS["ours"]:
        parts.append(args.ours)
    if (args.powersgd_rank, args.powersgd_warmup) != (DEFAULTS["powersgd_rank"], DEFAULTS["powersgd_warmup"]):
        parts.append(f"r{args.powersgd_rank}w{args.powersgd_warmup}")
    if sorted(args.configs) != sorted(DEFAULTS["configs"]):
        parts.append("subset")
    if args.repeats != DEFAULTS["repeats"]:
        parts.append(f"x{args.repeats}")
    return "-".join(parts)


def label(record_or_name, ours: str) -> str:
    """A configuration's name for tables and plots: 'ours' spelt out as its algorithm; with --repeats,
    which run."""
    name = record_or_name if isinstance(record_or_name, str) else record_or_name["config"]
    name = name.replace("ours", f"ours {ours}", 1) if name.startswith("ours") else name
    run = None if isinstance(record_or_name, str) else record_or_name.get("run")
    return f"{name} (run {run})" if run else name


# --------------------------------------------------------------------------- worker
def worker(args) -> int:
    cfg = json.loads(Path(args.config).read_text())
    rank, n, spec = args.rank, cfg["world_size"], cfg["spec"]

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from utils import run as trainer_run
    from utils.data import load_mnist
    from utils.model import Net

    torch.set_num_threads(1)              # as every rank of train.py on a shared machine
    torch.use_deterministic_algorithms(True)
    timeout = datetime.timedelta(seconds=cfg["op_timeout"])
    dist.init_process_group("gloo", init_method=cfg["init_method"], rank=rank, world_size=n, timeout=timeout)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    prefix = f"  [{cfg['label']} N={n} {spec['name']}]"

    train_images, train_labels, test_images, test_labels = load_mnist(str(REPO / "data"))
    if cfg["train_subset"]:
        train_images, train_labels = train_images[:cfg["train_subset"]], train_labels[:cfg["train_subset"]]
    if cfg["test_subset"]:
        test_images, test_labels = test_images[:cfg["test_subset"]], test_labels[:cfg["test_subset"]]
    run_args = argparse.Namespace(batch_size=max(1, cfg["global_batch"] // n), global_batch=cfg["global_batch"],
                                  seed=cfg["seed"], epochs=cfg["epochs"], lr=cfg["lr"])

    def batches_of(epoch):
        """This rank's batches, as the trainer draws them (their weights are 1 when N divides the global batch)."""
        return [batch for batch, _ in trainer_run.batches_of_epoch(len(train_labels), epoch, run_args)]
    steps_per_epoch = len(batches_of(1))
    slowest = torch.zeros(1)

    def max_over_ranks(seconds: float) -> float:
        slowest[0] = seconds
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return float(slowest[0])

    # compute only: a scratch copy of the model, every rank at once, no communication
    torch.manual_seed(cfg["seed"])
    scratch = Net()
    opt, sched = trainer_run.make_optimizer(scratch, run_args, steps_per_epoch)
    batches = batches_of(1)
    warm = min(5, cfg["compute_steps"])
    for s in range(warm + cfg["compute_steps"]):
        if s == warm:
            dist.barrier()
            t0 = time.perf_counter()
        batch = batches[s % len(batches)]
        loss = F.cross_entropy(scratch(train_images[batch]), train_labels[batch])
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        loss.item()
    compute_s = max_over_ranks((time.perf_counter() - t0) / cfg["compute_steps"])
    del scratch, opt, sched

    # the run
    torch.manual_seed(cfg["seed"])
    model = Net()
    optimizer, scheduler = trainer_run.make_optimizer(model, run_args, steps_per_epoch)
    gsum, forward = None, model
    if spec["kind"] == "ours":
        gsum = trainer_run.GradientSum(model, argparse.Namespace(
            **cfg["ours"], chunks="auto" if cfg["ours"]["overlap"] else ring_chunks(), bucket_mb=1.0,
            timeout=cfg["op_timeout"], compress=spec["compress"], powersgd_rank=cfg["powersgd_rank"],
            powersgd_warmup=cfg["powersgd_warmup"], seed=cfg["seed"]), optimizer, scheduler)
    else:
        forward, _ = make_ddp(model, None if spec["compress"] == "none" else spec["compress"],
                              cfg["powersgd_rank"], cfg["powersgd_warmup"], cfg["seed"])
    say(f"{prefix} {n} ranks up, batch {run_args.batch_size}/rank, {steps_per_epoch} steps/epoch, "
        f"compute only {compute_s * 1e3:.1f} ms/step (GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', '-')})")

    nic = os.environ.get("GLOO_SOCKET_IFNAME")
    points, train_s, loss_sum, loss_steps = [], 0.0, 0.0, 0
    tx_start, sent_start = nic_tx_bytes(nic), gradient_bytes_sent(gsum)
    wall_start = time.time()

    def evaluate(epoch: int, step: int):
        """Clock stopped: rank 0 evaluates, the others wait at the barrier."""
        nonlocal loss_sum, loss_steps
        if rank == 0:
            accuracy = trainer_run.test_model(model, test_images, test_labels)
            model.train()
            points.append({"epoch": round(step / steps_per_epoch, 4), "step": step, "seconds": train_s,
                           "accuracy": accuracy, "train_loss": loss_sum / loss_steps if loss_steps else None})
            say(f"{prefix} step {step} (epoch {step / steps_per_epoch:.2f}): test accuracy {accuracy:.2%}, "
                f"{train_s:.1f} s of training")
        loss_sum, loss_steps = 0.0, 0
        dist.barrier()

    model.train()
    evaluate(0, 0)
    at = set(eval_steps(steps_per_epoch, cfg["evals_per_epoch"]))
    global_step = 0
    for epoch in range(1, cfg["epochs"] + 1):
        batches = batches_of(epoch)
        dist.barrier()
        t0 = time.perf_counter()
        for step, batch in enumerate(batches, 1):
            loss = F.cross_entropy(forward(train_images[batch]), train_labels[batch])
            loss.backward()
            if gsum is not None:              # as utils/run.train_model
                gsum.sum()
                gsum.step()
            else:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            loss_sum += loss.item()
            loss_steps += 1
            global_step += 1
            if step in at:
                if gsum is not None:
                    gsum.finish()             # the step's (lazy) update is training time
                train_s += max_over_ranks(time.perf_counter() - t0)
                evaluate(epoch, global_step)
                dist.barrier()
                t0 = time.perf_counter()
    tx_end, sent_end = nic_tx_bytes(nic), gradient_bytes_sent(gsum)
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    digests = [None] * n
    dist.all_gather_object(digests, hashlib.sha256(flat.numpy().tobytes()).hexdigest())
    tx = [None] * n
    dist.all_gather_object(tx, [None if tx_start is None or tx_end is None else tx_end - tx_start,
                                None if sent_start is None or sent_end is None else sent_end - sent_start])
    if rank == 0:
        write_file(Path(cfg["out"]), json.dumps({
            "world_size": n, "steps_per_epoch": steps_per_epoch, "steps": global_step,
            "batch_size": run_args.batch_size, "compute_step_s": compute_s, "points": points,
            "train_seconds": train_s, "wall_seconds": time.time() - wall_start,
            "params_identical": len(set(digests)) == 1,
            "wire_bytes": [t[0] for t in tx], "sent_bytes": [t[1] for t in tx],
            "counts_bytes": gradient_bytes_sent(gsum) is not None}).encode())
    if gsum is not None:
        gsum.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def ring_chunks():
    from utils.ring import auto_chunks
    return auto_chunks(MODEL_NUMEL)


# --------------------------------------------------------------------------- driver
def estimate_seconds(n: int, rate_bits: float | None, steps: int, evals: int) -> float:
    """Rough, generous time of one world (start-up, compute-only timing, training, evaluations), for the
    hard timeout."""
    cores = os.cpu_count() or 1
    compute = 0.03 * max(1.0, n / cores)                                        # 64 images over N ranks
    comm = 2 * (2 * MODEL_NUMEL * 4) / ((rate_bits or 8e9) / 8) * max(1.0, (n - 1) / 2)
    return 60 + steps * (compute + comm) + 5 * evals


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
        "sent_kb_per_step": statistics.mean(sent) / steps / 1e3 if sent and steps and raw["counts_bytes"] else None,
        "counts_bytes": raw["counts_bytes"], "params_identical": raw["params_identical"],
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


def plot(records: list[dict], path: Path, title: str, worlds: list[int], ours: str, target: float) -> None:
    """Test accuracy vs training seconds, a line per configuration, a panel per N."""
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
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    write_file(path, buf.getvalue())


def run_all(args, specs: list[dict], rate: str | None, est: dict, done=lambda records: None) -> list[dict]:
    """Every configuration in every world size, one world at a time (one emulated cluster for all);
    done(records so far) after each world."""
    records = []
    op_timeout = 120.0                    # gloo: any single send/recv/collective, as train.py's default
    ours = parse_ours(args.ours)
    with tempfile.TemporaryDirectory(prefix="time-to-accuracy-") as tmpdir:
        tmp = Path(tmpdir)
        os.chmod(tmp, 0o755)
        with (cluster.Cluster(hosts=max(args.world_sizes), rate=rate) if rate else contextlib.nullcontext()) as cl:
            if rate:
                print(f"# cluster {rate}: {cl.hosts} hosts "
                      f"{', '.join(f'{cl.addr(r)}/{cl.nic(r)}' for r in range(cl.hosts))}", flush=True)
            k = 0
            for n, run, spec in ((n, run, spec) for n in args.world_sizes for run in range(1, args.repeats + 1)
                                 for spec in specs):   # round-robin: run r of every configuration, then r+1
                k += 1
                tag = f"n{n}-{spec['name'].replace('+', '-')}-{run}"
                cfg_path, out_path = tmp / f"config-{tag}.json", tmp / f"result-{tag}.json"
                port = (29700 + 7 * k + os.getpid() % 5) if cl else free_port()
                host0 = cl.addr(0) if cl else "127.0.0.1"
                cfg_path.write_text(json.dumps({
                    "world_size": n, "init_method": f"tcp://{host0}:{port}", "op_timeout": op_timeout,
                    "spec": spec, "ours": ours, "seed": args.seed, "epochs": args.epochs, "lr": args.lr,
                    "global_batch": args.global_batch, "train_subset": args.train_subset,
                    "test_subset": args.test_subset, "evals_per_epoch": args.evals_per_epoch, "compute_steps": args.compute_steps,
                    "powersgd_rank": args.powersgd_rank, "powersgd_warmup": args.powersgd_warmup,
                    "out": str(out_path), "label": rate or "loopback"}))
                timeout = args.timeout or (120 + 2 * est[n])
                t, cpu_before, load_before, mine = time.time(), proc_table(), loadavg(), set()
                procs = run_world(str(Path(__file__).resolve()), n, cfg_path, cl, f"rank{{rank}}-{tag}.log",
                                  timeout, f"{rate or 'loopback'} N={n} {spec['name']}" + (f" run {run}" if args.repeats > 1 else ""),
                                  env={"TORCH_CPP_LOG_LEVEL": "ERROR"},
                                  while_running=lambda ps: mine.update(descendants({p.pid for p in ps})))
                if not out_path.exists():
                    raise LaunchError(f"N={n} {spec['name']}: the ranks exited without writing {out_path}")
                rec = summarize(json.loads(out_path.read_text()), spec, n, args.target, args.epochs)
                if args.repeats > 1:
                    rec["run"] = run
                cores, top = foreign_cpu(cpu_before, proc_table(), mine | {p.pid for p in procs}, time.time() - t)
                rec["load"] = {"foreign_cpu_cores": round(cores, 2), "foreign_top": top,
                               "loadavg_before": load_before, "loadavg_after": loadavg()}
                if cores > 0.1:
                    print(f"  WARNING N={n} {spec['name']}: other processes used {cores:.2f} of {os.cpu_count()} "
                          f"cores during the run ({', '.join(top)}); times may be inflated", flush=True)
                records.append(rec)
                done(records)
                print(f"  N={n} {label(rec, args.ours)}: {fmt(rec['time_to_target_s'], '{:.1f} s', 'not reached')}"
                      f" to {args.target:.1%}, {rec['train_seconds']:.0f} s training, final "
                      f"{rec['final_accuracy']:.2%} ({time.time() - t:.0f}s, hard timeout {timeout:.0f}s)",
                      flush=True)
    return records


def write_results(args, records, mode, rate, command, notes, started, complete=True):
    """The JSON, markdown and PNG of `records`; a run still going (complete=False) says so in both."""
    import torch
    title = (f"time to accuracy, {rate + ' per host' if rate else 'loopback'}; global batch {args.global_batch}, "
             f"{args.epochs} epoch(s)\n1 thread/rank, {os.cpu_count()} cores; {platform.node()}, torch {torch.__version__}")
    uncounted = sorted({r["config"] for r in records if r["kind"] == "ours" and r["compress"] != "none"
                        and not r["counts_bytes"]})
    warning = (f"WARNING: utils.run.GradientSum counts no bytes (it predates compression): "
               f"{', '.join(uncounted)} ran UNCOMPRESSED" if uncounted else "")
    tbl = table(records, args.ours, args.target, args.epochs)
    if args.repeats > 1:
        tbl += f"\n\nMedians over {args.repeats} runs, run round-robin:\n\n" + medians(records, args.ours, args.target)
    load_line = "; ".join(f"N={r['world_size']} {r['config']}: other processes {r['load']['foreign_cpu_cores']:.2f} cores"
                          for r in records)
    partial = "" if complete else f"**PARTIAL: {len(records)} world(s) done when this was written.**  \n"
    md = (f"### Time to {args.target:.1%} test accuracy, {rate or 'loopback'}\n\n{partial}`{command}`  \n{notes}.  \n"
          f"Training seconds only (evaluation excluded; each segment's time is the slowest rank's). "
          f"'x compute' = time to target / (compute-only step time x the same steps).  \nLoad: {load_line}\n\n{tbl}\n"
          + (f"\n{warning}\n" if warning else ""))
    result = {
        "mode": mode, "rate": rate, "world_sizes": args.world_sizes, "command": command, "notes": notes,
        "complete": complete,
        "epochs": args.epochs, "evals_per_epoch": args.evals_per_epoch, "target": args.target,
        "global_batch": args.global_batch, "train_subset": args.train_subset,
        "test_subset": args.test_subset, "lr": args.lr, "seed": args.seed,
        "ours": args.ours, "powersgd_rank": args.powersgd_rank, "powersgd_warmup": args.powersgd_warmup,
        "compute_steps": args.compute_steps, "configs": args.configs, "repeats": args.repeats,
        "host": {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "torch": torch.__version__, "kernel": platform.release()},
        "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "seconds": round(time.time() - started, 1),
        "free_network": {str(n): free_network([r for r in records if r["world_size"] == n]) for n in args.world_sizes},
        "results": records,
    }
    out = Path(args.results_dir) / results_stem(args, mode)
    write_file(out.with_suffix(".json"), (json.dumps(result, indent=1) + "\n").encode())
    write_file(out.with_suffix(".md"), md.encode())
    plot(records, out.with_suffix(".png"), title, args.world_sizes, args.ours, args.target)
    return out, tbl, warning


def driver(args) -> int:
    mode = "loopback" if args.loopback else "cluster"
    rate = None if args.loopback else args.rate
    specs = [parse_config(c) for c in args.configs]
    subset = args.train_subset or 60000
    steps = {n: args.epochs * ((subset // n) // max(1, args.global_batch // n)) for n in args.world_sizes}
    est = {n: estimate_seconds(n, parse_rate(rate) if rate else None, steps[n],
                               args.epochs * args.evals_per_epoch + 1) for n in args.world_sizes}
    command = " ".join(["python3", "bench/time_to_accuracy.py"] + sys.argv[1:])
    notes = (f"global batch {args.global_batch} ({', '.join(f'{args.global_batch // n}/rank at N={n}' for n in args.world_sizes)}), "
             f"{args.epochs} epoch(s) of {'the first ' + str(args.train_subset) if args.train_subset else 'all 60,000'} "
             f"training images{f' (test: the first {args.test_subset})' if args.test_subset else ''}, Adam + one-cycle (peak lr {args.lr:g}), seed {args.seed}, 1 thread per rank; "
             f"ours = utils.run.GradientSum {args.ours}; PowerSGD rank {args.powersgd_rank}, "
             f"{args.powersgd_warmup} plain steps first (ours and DDP's); evaluated on the {args.test_subset or 10000:,} test images "
             f"{args.evals_per_epoch}x per epoch, clock paused; compute only = {args.compute_steps} steps of all "
             f"N ranks at once without communication, per world; {os.cpu_count()} CPU cores")
    print(f"# time-to-accuracy benchmark: mode={mode}, "
          + (f"egress cap per host {rate}" if rate else "127.0.0.1, no cap")
          + f", N={','.join(map(str, args.world_sizes))}; configurations {', '.join(args.configs)} "
          f"(each in its own world, one after the other{f', {args.repeats} rounds' if args.repeats > 1 else ''})")
    print(f"# {notes}")
    print("# estimate (generous) " + ", ".join(f"N={n} ~{len(specs) * args.repeats * s:.0f}s" for n, s in est.items()),
          flush=True)
    started = time.time()
    total = len(specs) * len(args.world_sizes) * args.repeats

    def save(records):
        """Write the results so far (atomically): a failed or interrupted run keeps its finished worlds."""
        return write_results(args, records, mode, rate, command, notes, started, complete=len(records) == total)
    try:
        records = run_all(args, specs, rate, est, done=save)
    except LaunchError as e:
        print(f"time_to_accuracy.py: FAILED: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if type(e).__name__ == "ClusterError":
            print(f"time_to_accuracy.py: cluster: {e}", file=sys.stderr)
            return 2
        raise
    out, tbl, warning = save(records)
    print(f"\n{tbl}\n")
    if warning:
        print(warning)
    print(f"wrote {out.with_suffix('.json')}, .md, .png  ({time.time() - started:.0f}s)")
    bad = [f"N={r['world_size']} {r['config']}" for r in records if not r["params_identical"]]
    if bad:
        print("time_to_accuracy.py: ranks ended with DIFFERENT parameters in: " + ", ".join(bad), file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    def positive(kind):
        def parse(text):
            try:
                v = kind(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
            if not (v > 0 and math.isfinite(v)):
                raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
            return v
        return parse

    def fraction(text):
        v = positive(float)(text)
        if v > 1:
            raise argparse.ArgumentTypeError(f"--target is a fraction of the test set (e.g. 0.99), got {text}")
        return v

    ap = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=__doc__)
    ap.add_argument("--loopback", action="store_true", help="all ranks on 127.0.0.1 (default: emulated cluster)")
    ap.add_argument("--rate", default=DEFAULTS["rate"], help=f"per-host egress cap, tc syntax (default {DEFAULTS['rate']})")
    ap.add_argument("--world-sizes", default=",".join(map(str, DEFAULTS["world_sizes"])), type=number_list(int))
    ap.add_argument("--configs", default=",".join(DEFAULTS["configs"]), type=lambda s: s.split(","),
                    help=f"which (default {','.join(DEFAULTS['configs'])}); ours/ddp, +fp16, +bf16 or +powersgd")
    ap.add_argument("--ours", default=DEFAULTS["ours"],
                    help=f"our configuration, <algorithm>[+overlap[+lazy]] (default {DEFAULTS['ours']})")
    ap.add_argument("--epochs", type=positive(int), default=DEFAULTS["epochs"])
    ap.add_argument("--evals-per-epoch", type=positive(int), default=DEFAULTS["evals_per_epoch"])
    ap.add_argument("--target", type=fraction, default=DEFAULTS["target"], help="test accuracy (default 0.99)")
    ap.add_argument("--train-subset", type=positive(int), help="train on only the first N training images")
    ap.add_argument("--test-subset", type=positive(int),
                    help="evaluate on only the first N test images (quick checks; default all 10,000)")
    ap.add_argument("--global-batch", type=positive(int), default=DEFAULTS["global_batch"],
                    help="images per step over all ranks (default 64, train.py's)")
    ap.add_argument("--lr", type=positive(float), default=DEFAULTS["lr"])
    ap.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    ap.add_argument("--powersgd-rank", type=positive(int), default=DEFAULTS["powersgd_rank"])
    ap.add_argument("--powersgd-warmup", type=int, default=DEFAULTS["powersgd_warmup"],
                    help=f"plain steps before PowerSGD starts, ours and DDP's (default {DEFAULTS['powersgd_warmup']}; >= 2)")
    ap.add_argument("--repeats", type=positive(int), default=DEFAULTS["repeats"],
                    help="train every configuration this many times, round-robin, and report medians (default 1)")
    ap.add_argument("--compute-steps", type=positive(int), default=40,
                    help="compute-only steps timed per world (default 40)")
    ap.add_argument("--timeout", type=float, default=0, help="hard limit per world in s (default: from the plan)")
    ap.add_argument("--results-dir", default=str(RESULTS))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    try:
        for c in args.configs:
            parse_config(c)
        parse_ours(args.ours)
    except ValueError as e:
        ap.error(str(e))
    if len(set(args.configs)) != len(args.configs):
        ap.error("--configs: a configuration named twice")
    if any(n < 2 for n in args.world_sizes):
        ap.error("world sizes must be >= 2")
    if args.powersgd_warmup < 2:
        ap.error("--powersgd-warmup must be >= 2 (DDP's PowerSGD hook needs 2 plain steps first)")
    if any(args.global_batch // n < 1 for n in args.world_sizes):
        ap.error(f"--global-batch {args.global_batch} leaves no image per rank at N={max(args.world_sizes)}")
    if args.train_subset and any(args.train_subset // n < args.global_batch // n for n in args.world_sizes):
        ap.error(f"--train-subset {args.train_subset} is less than one step of {args.global_batch} images")
    if args.train_subset and args.train_subset > 60000:
        ap.error("--train-subset: MNIST has 60000 training images")
    if args.test_subset and args.test_subset > 10000:
        ap.error("--test-subset: MNIST has 10000 test images")
    if not args.loopback:
        try:
            parse_rate(args.rate)
        except argparse.ArgumentTypeError as e:
            ap.error(str(e))
    return run_driver(driver, args, "time_to_accuracy.py")


if __name__ == "__main__":
    sys.exit(main())
