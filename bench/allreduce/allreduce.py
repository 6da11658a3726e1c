#!/usr/bin/env python3
"""All-reduce benchmark for utils/comm/ring.py, in the style of nccl-tests.

Times gloo, two-pass, two-pass-pipelined, ring and hierarchical side by side (interleaved, the
order rotating) for world sizes N and buffer sizes from 4 KiB to 16 MiB plus the trainer's
gradient ("model"); every result is checked against a float64 sum and across ranks.

    python3 bench/allreduce/allreduce.py  # loopback, 127.0.0.1
    python3 bench/allreduce/allreduce.py --cluster --rate 200mbit # emulated hosts (scripts/netns.py), egress capped

Columns, correctness bounds, --candidate and --ring-file: bench/allreduce/NOTES.md ("All-reduce",
"Command-line details"). Results: bench/results/allreduce/allreduce-<mode>[-<what differs>].{json,md,png}.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # bench/common: harness, stats (run directly)
import allreduce_report as report
import harness
from allreduce_worker import ELEMENT, worker

DEFAULT_ALGORITHMS = ("gloo", "two-pass", "two-pass-pipelined", "ring")  # hierarchical: with --ranks-per-host
TIMING = (
    "per repetition: barrier, t0, op, t1 on every rank; time = max over ranks; "
    "median over timed repetitions; algorithms interleaved per repetition, order rotated"
)
DEFAULT_SIZES = "4K,16K,64K,256K,1M,model,2M,4M,8M,16M"
UNITS = {"": 1, "B": 1} | {
    u: 1 << s for s, us in ((10, "K KB KIB"), (20, "M MB MIB"), (30, "G GB GIB")) for u in us.split()
}


def parse_size(text: str, model_numel: int) -> tuple[str, int]:
    """'4K' / '16M' / '1048576' / 'model' -> (label, bytes); K/M/G are binary (KiB, MiB, GiB)."""
    t = text.strip()
    if t.lower() == "model":
        return "model", model_numel * ELEMENT
    num = t.rstrip("BbKkMmGgIi")
    if not num.isdigit() or t[len(num) :].upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 4K, 1M, 16M, 65536 or 'model'")
    nbytes = int(num) * UNITS[t[len(num) :].upper()]
    if nbytes < ELEMENT or nbytes % ELEMENT:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a positive multiple of {ELEMENT} bytes")
    return report.human(nbytes), nbytes


def expected_seconds(alg: str, n: int, nbytes: int, rate_bytes: float, chunks: int) -> float:
    """Rough bandwidth-bound time of one all-reduce (used for timeouts and sanity only)."""
    s = nbytes / rate_bytes
    if alg in ("gloo", "ring"):
        return 2 * (n - 1) / n * s
    if alg == "two-pass" or chunks <= 1:
        return (n + max(0, n - 2)) * s  # N hops of pass 1, N-2 of pass 2, one after another
    return 2 * s + (2 * n - 2) * s / chunks  # busiest link carries 2S; plus pipeline fill


def driver(args) -> int:
    mode, k = "cluster" if args.cluster else "loopback", args.ranks_per_host
    rate_bits = harness.parse_rate(args.rate) if args.cluster and args.rate else None
    rate_bytes, worlds = rate_bits / 8 if rate_bits else None, args.world_sizes
    sizes = {}
    for label, nbytes in args.sizes:  # one row per byte count; "model" keeps its name
        sizes[nbytes] = label if label == "model" else sizes.get(nbytes, label)
    plan = []
    for nbytes, label in sorted(sizes.items()):
        big = nbytes >= args.big_from
        iters, warmup = (args.big_iters, args.big_warmup) if big else (args.iters, args.warmup)
        plan.append({"label": label, "bytes": nbytes, "iters": iters, "warmup": warmup})

    # Time budget per world (the hard timeout) and per-operation timeout of the process group.
    from utils.comm.ring import auto_chunks

    def seconds(alg, n, p, chunks=None):  # N·K ranks: a flat ring's time
        chunks = chunks or args.chunks or auto_chunks(p["bytes"] // ELEMENT)
        return expected_seconds(alg, n * k, p["bytes"], rate_bytes or 50e6, chunks)

    algs = args.algorithms + ["ring"] * len(args.candidate)
    est = {n: sum((p["iters"] + p["warmup"]) * seconds(a, n, p) for p in plan for a in algs) for n in worlds}
    op_timeout = max(60.0, 20 * max(seconds("two-pass", n, plan[-1], 1) for n in worlds))
    cap, hosts = f", egress cap {args.rate} per host" if rate_bits else "", f" hosts × {k} ranks each" if k > 1 else ""
    under_test = f", ring.py under test: {args.ring_file}" if args.ring_file else ""
    under_test += "".join(f", ring:{Path(f).stem} = ring_sum of {f}" for f in args.candidate)
    what = f"N={','.join(map(str, worlds))}{hosts}, algorithms={','.join(args.algorithms)}{under_test}"
    print(f"# all-reduce benchmark: mode={mode}{cap}, {what}")
    labels = [p["label"] + (f" ({pretty_bytes(p['bytes'])})" if p["label"] == "model" else "") for p in plan]
    print(f"# sizes: {', '.join(labels)}")
    iters_note = f"{args.iters} timed + {args.warmup} warm-up repetitions"
    if any(p["bytes"] >= args.big_from for p in plan):
        big = f"{args.big_iters} timed + {args.big_warmup} warm-up (fewer, to keep the run short)"
        iters_note += f"; sizes >= {report.human(args.big_from)}: {big}"
    print(f"# {iters_note}; time = max over ranks, median over repetitions")
    estimate = ", ".join(f"N={n} ~{est[n]:.0f}s" for n in worlds)
    print(f"# bandwidth-bound estimate: {estimate}" + (" (at the cap)" if rate_bits else " (assuming 50 MB/s)"))
    sys.stdout.flush()

    records, started, load, wire = [], time.time(), {}, None
    cfg = harness.pick(args, "seed chunks algorithms ranks_per_host") | {"fault": args.self_test_fault}
    cfg |= {"ring_file": str(Path(args.ring_file).resolve()) if args.ring_file else None, "sizes": plan}
    cfg["candidates"] = [str(Path(f).resolve()) for f in args.candidate]
    with (
        tempfile.TemporaryDirectory(prefix="allreduce-bench-") as tmpdir,
        harness.emulated_cluster(args.rate if args.cluster else None, max(worlds), k) as cl,
    ):
        wire = set_up_wire(cl, args.tcp_cc, rate_bits) if cl else None
        for i, n in enumerate(worlds):
            timeout, t = args.timeout or (120 + 3 * est[n]), time.time()
            world = harness.world_config(cl, 29500, i, n * k) | {"op_timeout": op_timeout}
            # exit code 3 is a rank that found a wrong sum: its results are written
            world |= {"hosts": n}
            raw = harness.launch_world(WORKER, cfg | world, cl, Path(tmpdir), f"n{n}", timeout, f"N={n}", (0, 3), k)
            raw["hosts"], raw["ranks_per_host"] = n, k
            print(f"  N={n}: done in {time.time() - t:.0f}s (hard timeout {timeout:.0f}s)", flush=True)
            records += report.summarize(raw, rate_bytes)
            load[n] = raw["load"]

    failures = [f"N={r['world_size']} size={r['size']} algorithm={r['algorithm']}: " for r in records]
    failures = [where + p for where, r in zip(failures, records) for p in r["problems"]]
    if wire and rate_bytes:
        # What the wire allows: tbf charges a whole frame (payload + 66 bytes of Ethernet/IP/TCP
        # headers with timestamps) per MSS of payload, and its bucket starts each op full.
        for r in records:
            if r["limit_ms"]:
                r["floor_ratio"] = max(0.0, wire["factor"] - wire["burst_bytes"] / rate_bytes / (r["limit_ms"] / 1e3))
    targets = report.evaluate_targets(records, mode, k)
    host = harness.host_info()
    where = f", {args.rate} egress per host" if rate_bits else " (127.0.0.1)"
    title = f"all-reduce, {mode}{where}; {host['node']}, torch {host['torch']}"
    heading = f"### All-reduce benchmark, {mode}" + (f" ({args.rate} per host)" if rate_bits else "")
    heading += f", {k} ranks per host (N counts hosts)" if k > 1 else ""
    line = harness.command_line("allreduce/allreduce.py")
    md = f"{heading}\n\n`{line}`  \n{iters_note}.\n\n{report.table(records)}\n\n```\n"
    md += f"{report.target_lines(targets)}\n{report.load_lines(load)}\n```\n"
    command = [Path(sys.executable).name, "bench/allreduce/allreduce.py"] + sys.argv[1:]
    result = dict(mode=mode, rate=args.rate if rate_bits else None, rate_bits_per_s=rate_bits, command=command)
    result |= dict(world_sizes=worlds, ranks_per_host=k, sizes=plan, algorithms=args.algorithms)
    result |= dict(chunks_override=args.chunks, model_numel=args.model_numel, seed=args.seed)
    result |= dict(ring_file=args.ring_file or "utils/comm/ring.py", candidates=args.candidate)
    result["timing"] = TIMING
    result |= harness.run_info(host, started) | {"other_load": {str(n): v for n, v in load.items()}, "wire": wire}
    result |= dict(correct=not failures, failures=failures, targets=targets, results=records)
    out = Path(args.results_dir) / results_stem(mode, args.rate if rate_bits else None, args.ring_file, args.tcp_cc, k)
    harness.write_results(out, result, md, report.plot(records, title, rate_bytes, wire["burst_bytes"] if wire else 0))

    print(f"\n{report.table(records)}\n")
    print("Targets" + ("" if mode == "cluster" else " (only evaluated with --cluster --rate)") + ":")
    print(report.target_lines(targets))
    print(report.load_lines(load))
    print(f"\nwrote {out}.json, .md, .png  ({time.time() - started:.0f}s)")
    if failures:
        print("\nallreduce.py: CORRECTNESS FAILURE:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


def pretty_bytes(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.2f} MiB" if nbytes >= 1 << 20 else f"{nbytes / 1024:.1f} KiB"


def set_up_wire(cl, tcp_cc: str | None, rate_bits: int | None) -> dict:
    """The emulated hosts' TCP congestion control (--tcp-cc), and what their wire lets through: the
    MTU's header overhead and tbf's burst, for the wire floor under the targets."""
    if tcp_cc:  # per-namespace setting; only kernel-"allowed" ones work there
        for r in range(cl.hosts):
            done = cl.run_on(r, ["sysctl", "-q", "-w", f"net.ipv4.tcp_congestion_control={tcp_cc}"], timeout=10)
            if done.returncode:
                allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().strip()
                raise harness.LaunchError(
                    f"--tcp-cc {tcp_cc}: {done.stderr.decode().strip()} (a network namespace may "
                    f"only pick from net.ipv4.tcp_allowed_congestion_control = {allowed!r})"
                )
    mtu = int(cl.run_on(0, ["cat", f"/sys/class/net/{cl.nic(0)}/mtu"], timeout=10, check=True).stdout)
    cc = cl.run_on(0, ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"], timeout=10).stdout.strip()
    burst = harness.netns.tbf_burst(rate_bits) if rate_bits else 0
    wire = {"mtu": mtu, "factor": (mtu + 14) / (mtu - 52), "tcp_cc": cc.decode() or "?", "burst_bytes": burst}
    tbf = f"; tbf rate {rate_bits} bit/s, burst {burst} B, latency {harness.netns.TBF_LATENCY}" if rate_bits else ""
    print(f"# cluster wire: MTU {mtu}, TCP {wire['tcp_cc']}{tbf}", flush=True)
    return wire


def results_stem(mode: str, rate: str | None, ring_file: str | None, tcp_cc: str | None, per_host: int = 1) -> str:
    """The results files' name: each capped rate, ring file, TCP setting and number of ranks per
    host gets its own, so that no run overwrites another's (allreduce-cluster-200mbit-reno.*,
    allreduce-loopback.*, allreduce-cluster-200mbit-reno-2-per-host.*)."""
    ring, hosts = Path(ring_file).stem if ring_file else None, f"{per_host}-per-host" if per_host > 1 else None
    return harness.results_stem(f"allreduce-{mode}", rate, ring, tcp_cc, hosts)


def main(argv=None) -> int:
    ap = harness.bench_parser(__doc__)
    ap.add_argument("--cluster", action="store_true", help="run each rank on its own emulated host (root)")
    ap.add_argument("--rate", help="per-host egress cap in --cluster mode, tc syntax, e.g. 200mbit")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma list (K/M binary, 'model'); default {DEFAULT_SIZES}")
    ap.add_argument("--model-numel", type=int, default=harness.MODEL_NUMEL, help="float32 values of the 'model' row")
    ap.add_argument("--chunks", type=int, default=0, help="pieces for two-pass-pipelined (default: auto_chunks)")
    ap.add_argument("--big-from", default="8M", help="sizes from here use --big-iters/--big-warmup")
    ap.add_argument("--big-iters", type=int, default=5)
    ap.add_argument("--big-warmup", type=int, default=1)
    ap.add_argument("--ring-file", help="benchmark this copy of utils/comm/ring.py instead (e.g. a proposed patch)")
    ap.add_argument("--tcp-cc", metavar="ALGO", help="TCP congestion control inside the emulated hosts (e.g. reno)")
    ap.add_argument(
        "--candidate",
        action="append",
        default=[],
        metavar="RING_PY",
        help="also measure this file's ring_sum, interleaved, as 'ring:<file stem>'; repeatable",
    )
    ap.add_argument("--self-test-fault", choices=("wrong", "diverge"), help=argparse.SUPPRESS)  # tests only
    harness.add_options(ap, world_sizes="2,3,4", warmup=2, iters=7, algorithms=(report.ALGORITHMS, None), seed=1234)
    harness.add_world_options(ap, "allreduce", "world size")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    harness.check_options(ap, args)
    try:
        args.sizes = [parse_size(s, args.model_numel) for s in args.sizes.split(",") if s.strip()]
        args.big_from = parse_size(args.big_from, args.model_numel)[1]
        if args.rate:
            harness.parse_rate(args.rate)
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if args.algorithms is None:
        args.algorithms = list(DEFAULT_ALGORITHMS if args.ranks_per_host == 1 else ("gloo", "ring", "hierarchical"))
    if args.big_iters < 1 or args.big_warmup < 0 or args.chunks < 0:
        ap.error("--iters/--big-iters must be >= 1, --warmup/--big-warmup and --chunks >= 0")
    if args.cluster and not args.rate:
        ap.error("--cluster needs --rate, e.g. --rate 200mbit: the limit and the targets are for capped links")
    if (args.rate or args.tcp_cc) and not args.cluster:
        ap.error("--rate and --tcp-cc only apply with --cluster")
    for option, path in [("--ring-file", args.ring_file)] + [("--candidate", f) for f in args.candidate]:
        if path and not Path(path).is_file():
            ap.error(f"{option} {path}: no such file")
    return harness.run_driver(driver, args, "allreduce.py")


WORKER = str(Path(__file__).resolve())

if __name__ == "__main__":
    sys.exit(main())
