"""The speed ratios this project promises, side by side on this checkout and an older commit: one
command, so a slowdown is seen the day it lands.

    sudo python bench/regression/regression.py                   # this checkout, 3 rounds
    sudo python bench/regression/regression.py --against 2d84274  # and that commit, in the same rounds
    python bench/regression/regression.py --short                 # the suite's: 1 round, small, this tree only

Each configuration is one command line, the README's: `scripts/cluster.py train ...` (emulated
servers, root), the local launcher `train.py ...`, or one `train.py --rank R ...` per server. Its
result is the seconds of the `epoch 1/1 ... time X s` line rank 0 prints (to the metrics line's
precision, the same figure unrounded). --against COMMIT adds a `git worktree` of COMMIT, removed on
every way out, and runs that tree's own train.py and scripts/cluster.py. A round runs every
configuration of every tree once, in an order that turns round by round, so a slow minute hits all
alike. Per ratio and tree: both medians, the medians' ratio and the median of the per-round ratios.

  sync_every_hidden          --sync-every 64 --compress fp16 at 20 Mbit/s over uncapped (target <= 1.20)
  sync_every_vs_powersgd     the same at 20 Mbit/s over --compress powersgd every step (target <= 0.60)
  powersgd_vs_none_200mbit   --compress powersgd over float32 sums, 200 Mbit/s
  hierarchical_vs_flat       2 servers x 2 ranks, 200 Mbit/s: --allreduce hierarchical over two-pass
  balance_vs_equal           a server at half a core (--cpu 1=0.5): --balance over equal shares
  default_vs_gloo_allreduce  2 ranks over loopback: the default sum over --allreduce gloo (no root)
  shared_server              3 per-server commands on this machine over --nproc 3 (target <= 1.15; no root)

Without root the emulated-cluster ratios are skipped (with a line saying so), except under CI=true,
where that is an error. --short: ratios sync_every_hidden and default_vs_gloo_allreduce on fewer
images, 1 round, this tree only; it writes no files unless --results-dir.
Results: bench/results/regression/ (a .json and a .md a run, named after how it differs from the
default: regression-against-COMMIT); method: bench/regression/NOTES.md.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # bench/common: harness, stats (run directly)
from harness import (
    REPO,
    RESULTS,
    LaunchError,
    bench_parser,
    command_line,
    host_info,
    name_list,
    netns,
    positive,
    results_stem,
    rotated,
    run_driver,
    run_info,
    throttle,
    write_results,
)
from stats import LoadWatch, compare, fmt, md_head, md_row, quiet
from trees import Tree, add_worktree, helps, job_env, remove_worktree, this_tree, unsupported

from utils.setup.launch import free_port

TIMEOUT = 300.0  # s, the hard limit of each command (--timeout)
GRACE = 15.0  # s a stopped launcher gets to stop its own ranks (and tear its namespaces down) before SIGKILL
BASE = ("--epochs", "1", "--test-subset", "1000", "--data-dir", str(REPO / "data"))  # (one copy of MNIST for all)
EPOCH_LINE = re.compile(r"^(?:\[host0 [^\]]*\] )?epoch 1/1 .*?\btime ([\d.]+) s", re.M)


@dataclass(frozen=True)
class Config:
    """One command line: kind "cluster" (scripts/cluster.py train LAUNCH -- TRAIN), "local" (train.py
    LAUNCH TRAIN, the local launcher) or "servers" (one train.py --rank R TRAIN per rank; LAUNCH: the
    world size), each with BASE's flags."""

    kind: str
    launch: tuple
    train: tuple


@dataclass(frozen=True)
class Ratio:
    """a's epoch over b's (names of configurations), what that promises, and the issue's bound if any."""

    name: str
    promise: str
    target: float | None
    a: str
    b: str


# (name, what it promises, the target, its two configurations: A over B)
RATIOS = (
    Ratio("sync_every_hidden", "--sync-every 64 fp16 hides a 20 Mbit/s link", 1.20, "sync_20", "sync_free"),
    Ratio("sync_every_vs_powersgd", "at 20 Mbit/s, --sync-every 64 fp16 beats PowerSGD", 0.60, "sync_20", "psgd_20"),
    Ratio("powersgd_vs_none_200mbit", "PowerSGD pays at 200 Mbit/s", None, "psgd_200", "none_200"),
    Ratio("hierarchical_vs_flat", "2 servers x 2 ranks: hierarchical beats two-pass", None, "hier", "flat"),
    Ratio("balance_vs_equal", "--balance helps a server at half a core", None, "balance", "equal"),
    Ratio("default_vs_gloo_allreduce", "our default sum keeps up with gloo's all_reduce", None, "local", "gloo"),
    Ratio("shared_server", "per-server commands share one machine as --nproc does", 1.15, "servers3", "nproc3"),
)
# (the suite checks shared_server's rule itself: tests/world/test_per_server_threads.py)
SHORT = ("sync_every_hidden", "default_vs_gloo_allreduce")
NAMES = tuple(r.name for r in RATIOS)


def configs(short: bool) -> dict[str, Config]:
    """Every configuration the ratios name; --short's on fewer images (and --sync-every 8, so its
    50 steps still sum 6 times)."""
    sync = "--train-subset 3200 --sync-every 8" if short else "--train-subset 19200 --sync-every 64"
    local, shared = ("1600", "1600") if short else ("12800", "6400")
    four = "--hosts 2 --ranks-per-host 2"  # (2 servers x 2 ranks)

    def make(kind, launch, train):
        return Config(kind, tuple(launch.split()), BASE + tuple(train.split()))

    return {
        "sync_20": make("cluster", "--hosts 2 --rate 20mbit", f"{sync} --compress fp16"),
        "sync_free": make("cluster", "--hosts 2", f"{sync} --compress fp16"),
        "psgd_20": make("cluster", "--hosts 2 --rate 20mbit", "--train-subset 19200 --compress powersgd"),
        "psgd_200": make("cluster", "--hosts 2 --rate 200mbit", "--train-subset 19200 --compress powersgd"),
        "none_200": make("cluster", "--hosts 2 --rate 200mbit", "--train-subset 19200"),
        "hier": make("cluster", f"{four} --rate 200mbit", "--train-subset 12800 --allreduce hierarchical"),
        "flat": make("cluster", f"{four} --rate 200mbit", "--train-subset 12800"),
        "balance": make("cluster", "--hosts 2 --cpu 1=0.5", "--train-subset 12800 --balance"),
        "equal": make("cluster", "--hosts 2 --cpu 1=0.5", "--train-subset 12800"),
        "local": make("local", "", f"--train-subset {local}"),
        "gloo": make("local", "", f"--train-subset {local} --allreduce gloo"),
        "servers3": make("servers", "3", f"--train-subset {shared}"),
        "nproc3": make("local", "--nproc 3", f"--train-subset {shared}"),
    }


# --------------------------------------------------------------------------- running one command
def argvs(tree: Tree, cfg: Config, timeout: float) -> list[list[str]]:
    """The command lines of one configuration on `tree`: one, or one per server."""
    py = sys.executable
    if cfg.kind == "cluster":  # (its own limit first, so it tears its namespaces down itself)
        limit = ["--timeout", f"{max(timeout - GRACE - 5, 10):.0f}"]
        return [[py, str(tree.path / "scripts" / "cluster.py"), "train", *cfg.launch, *limit, "--", *cfg.train]]
    if cfg.kind == "local":
        return [[py, str(tree.path / "train.py"), *cfg.launch, *cfg.train]]
    n, where = int(cfg.launch[0]), f"tcp://127.0.0.1:{free_port()}"
    world = ["--world-size", str(n), "--init-method", where, "--gloo_socket_ifname", "lo"]
    return [[py, str(tree.path / "train.py"), "--rank", str(r), *world, *cfg.train] for r in range(n)]


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM proc's process group (a launcher stops its ranks and its namespaces), SIGKILL after GRACE."""
    for sig, wait in ((signal.SIGTERM, GRACE), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def wait_all(procs: list, timeout: float, watch: LoadWatch) -> str | None:
    """Wait for every process; None if all exited 0, else what went wrong. A failed server's peers
    get GRACE seconds, then every process still running is stopped, on every way out."""
    deadline, failed_at = time.monotonic() + timeout, None
    try:
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if time.monotonic() > deadline:
                return f"timed out after {timeout:.0f} s (--timeout)"
            if failed_at is not None and time.monotonic() > failed_at + GRACE:
                break
            watch.note(procs)
            time.sleep(0.2)
    finally:
        for p in procs:
            stop(p)
    codes = [p.returncode for p in procs]
    return None if set(codes) == {0} else f"exit codes {codes}"


def measure(tree: Tree, cfg: Config, timeout: float) -> dict:
    """One run of cfg on tree, each process in a fresh folder (so no run resumes another's checkpoint):
    {"seconds", "line_seconds", "load", "quiet"}, or {"error", "tail"}."""
    with tempfile.TemporaryDirectory(prefix="regression-") as tmp:
        os.chmod(tmp, 0o755)  # (the emulated hosts' ranks write there)
        procs, logs, watch = [], [], LoadWatch()
        try:
            for r, argv in enumerate(argvs(tree, cfg, timeout)):
                (Path(tmp) / f"p{r}").mkdir()
                logs.append(open(Path(tmp) / f"p{r}.log", "wb"))
                kw = dict(stdout=logs[-1], stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=job_env())
                procs.append(subprocess.Popen(argv, cwd=Path(tmp) / f"p{r}", start_new_session=True, **kw))
            error = wait_all(procs, timeout, watch)
        finally:
            for p in procs:  # (one that failed to start, or Ctrl-C while they start)
                stop(p)
            for log in logs:
                log.close()
        load = watch.result(procs)
        out = (Path(tmp) / "p0.log").read_text(errors="replace")
        found = EPOCH_LINE.findall(out)
        if error or not found:
            return {"error": error or "no `epoch 1/1 ... time X s` line", "tail": out.strip().splitlines()[-15:]}
        return {**epoch_seconds(float(found[-1]), Path(tmp) / "p0"), "load": load, "quiet": quiet(load)}


def epoch_seconds(line: float, folder: Path) -> dict:
    """The epoch's seconds: the line's, or the same figure unrounded from rank 0's metrics line
    (runs/metrics.jsonl, where it agrees with the line) since the line's 0.1 s is coarse for short runs."""
    try:
        precise = json.loads((folder / "runs" / "metrics.jsonl").read_text().splitlines()[-1])["seconds"]
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        precise = None
    ok = isinstance(precise, float) and abs(precise - line) <= 0.051
    return {"seconds": precise if ok else line, "line_seconds": line}


# --------------------------------------------------------------------------- the plan and its rounds
def capability(cfg: Config) -> str | None:
    """Why this machine cannot run cfg (the emulated cluster needs root, --cpu a cgroup CPU controller)."""
    if cfg.kind != "cluster":
        return None
    try:
        netns._check_privileges()
        if "--cpu" in cfg.launch:
            throttle.controller()
    except (netns.ClusterError, throttle.ThrottleError) as e:
        return str(e)
    return None


def choose(names: list[str], cfgs: dict, trees: list[Tree]) -> tuple[list[Ratio], dict, list[str]]:
    """The ratios that can run here, {(tree, ratio): why it cannot run on that tree} and the skip lines.
    LaunchError under CI=true if this machine lacks what one needs (CI must not skip)."""
    ratios, unable, lines = [], {}, []
    for ratio in (r for r in RATIOS if r.name in names):
        why = capability(cfgs[ratio.a]) or capability(cfgs[ratio.b])
        if why and os.environ.get("CI") == "true":
            raise LaunchError(f"{ratio.name} cannot run here under CI=true: {why}")
        if why:
            lines.append(f"skipped {ratio.name}: {why}")
            continue
        ratios.append(ratio)
    for tree in trees:
        text = helps(tree)
        for ratio in ratios:
            why = unsupported(cfgs[ratio.a], text) or unsupported(cfgs[ratio.b], text)
            if why:
                unable[tree.label, ratio.name] = why
                lines.append(f"skipped {ratio.name} on {tree.label}: {why}")
    return ratios, unable, lines


def run_rounds(rounds: int, ratios: list[Ratio], unable: dict, cfgs: dict, trees: list[Tree], timeout: float):
    """Every (tree, configuration) once a round, the configurations rotated and the trees' order turned
    round by round; a command that fails is not run again. Returns the rounds' records."""
    jobs = []
    for ratio in ratios:  # (a ratio's two configurations next to each other; one measured once if shared)
        jobs += [c for c in (ratio.a, ratio.b) if c not in jobs]
    failed, records = {}, []
    for k in range(rounds):
        order = [(c, t) for c in rotated(jobs, k) for t in (trees if k % 2 == 0 else trees[::-1])]
        record = {"round": k + 1, "order": [f"{t.label}:{c}" for c, t in order], "runs": {}}
        for name, tree in order:
            needed = any(name in (r.a, r.b) and (tree.label, r.name) not in unable for r in ratios)
            if not needed or (tree.label, name) in failed:
                continue
            run = measure(tree, cfgs[name], timeout)
            record["runs"].setdefault(tree.label, {})[name] = run
            if "error" in run:
                failed[tree.label, name] = run["error"]
                tail = "\n    ".join(run["tail"])
                print(f"round {k + 1}/{rounds}  {tree.label}  {name}: FAILED, {run['error']}\n    {tail}", flush=True)
            else:
                busy = "" if run["quiet"] else "  (the machine was busy besides it)"
                print(f"round {k + 1}/{rounds}  {tree.label}  {name}: {run['seconds']:.2f} s{busy}", flush=True)
        records.append(record)
    return records, failed


# --------------------------------------------------------------------------- the table
def summarize(ratio: Ratio, tree: Tree, records: list[dict]) -> dict:
    """One ratio on one tree from the rounds where both its commands ran: the two medians, their
    ratio, the paired median (bench/common/stats.compare), PASS/MISS against the target."""
    pairs = []
    for rec in records:
        runs = rec["runs"].get(tree.label, {})
        a, b = runs.get(ratio.a, {}).get("seconds"), runs.get(ratio.b, {}).get("seconds")
        if a is not None and b is not None:
            pairs.append((a, b))
    if not pairs:
        return {}
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    c = compare(a, b, ratio.target or math.inf)
    out = {"a_seconds": a, "b_seconds": b, "a_median": statistics.median(a), "b_median": statistics.median(b)}
    out.update(ratio=c["ratio"], paired_median_ratio=c["paired_median_ratio"], rounds=c["rounds"])
    return {**out, "status": c["status"]} if ratio.target else out


def table(ratios: list[Ratio], trees: list[Tree], found: dict, unable: dict, failed: dict) -> str:
    """The Markdown table: a row per ratio; per tree its two medians (s), their ratio, the paired median."""
    names = ["ratio", "what it promises", "target"]
    for t in trees:
        names += [f"{t.label} A s", f"{t.label} B s", f"{t.label} A/B", f"{t.label} paired"]
    lines = md_head([*names, "notes"], "lll" + "rrrr" * len(trees) + "l")
    for ratio in ratios:
        cells, notes = [f"`{ratio.name}`", ratio.promise, fmt(ratio.target, "≤ {:.2f}", "")], []
        for t in trees:
            s = found[ratio.name].get(t.label, {})
            cells += [fmt(s.get("a_median")), fmt(s.get("b_median")), fmt(s.get("ratio"), "{:.3f}")]
            cells.append(fmt(s.get("paired_median_ratio"), "{:.3f}"))
            broke = failed.get((t.label, ratio.a)) or failed.get((t.label, ratio.b))
            if (t.label, ratio.name) in unable:
                notes.append(f"{t.label}: skipped, {unable[t.label, ratio.name]}")
            elif broke:
                notes.append(f"{t.label}: failed, {broke}")
            elif "status" in s:
                notes.append(f"{t.label} {s['status']}")
        lines.append(md_row(*cells, "; ".join(notes)))
    return "\n".join(lines) + "\n"


def header(argv_line: str, trees: list[Tree], rounds: int, seconds: float) -> str:
    """The .md's top: the command, the commits measured, the CPU, the rounds."""
    measured = ", ".join(f"`{t.label}` ({t.note})" for t in trees)
    return (
        f"# bench/regression/regression.py\n\n    {argv_line}\n\n"
        f"Commits: {measured}. CPU: {cpu_model()}, {os.cpu_count()} cores. {rounds} round(s), {seconds:.0f} s. "
        "A/B: the ratio's first configuration's epoch over its second's (medians, s); paired: the median of "
        "the per-round A/B.\n\n"
    )


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        return re.search(r"^Model name:\s*(.+)$", out, re.M)[1].strip()
    except (OSError, subprocess.SubprocessError, TypeError):
        return "unknown CPU"


# --------------------------------------------------------------------------- main
def cleanup_namespaces(ratios: list[Ratio], cfgs: dict) -> None:
    """scripts/cluster.py cleanup of this tree: no namespace or CPU group of a killed command is left."""
    if any(cfgs[c].kind == "cluster" for r in ratios for c in (r.a, r.b)):
        cleanup = [sys.executable, str(REPO / "scripts" / "cluster.py"), "cleanup"]
        subprocess.run(cleanup, env=job_env(), stdout=subprocess.DEVNULL, timeout=120, check=False)


def measure_all(args, trees: list[Tree]) -> int:
    """Choose, run the rounds, print the table and write the results; 2 if a command of this tree failed."""
    started, cfgs = time.time(), configs(args.short)
    names = args.only or (SHORT if args.short else NAMES)
    ratios, unable, skips = choose(names, cfgs, trees)
    for line in skips:
        print(line, flush=True)
    try:
        records, failed = run_rounds(args.rounds, ratios, unable, cfgs, trees, args.timeout)
    finally:
        cleanup_namespaces(ratios, cfgs)
    found = {r.name: {t.label: summarize(r, t, records) for t in trees} for r in ratios}
    if args.short:  # no PASS/MISS: the targets are of the full runs' sizes
        for figures in (f for per_tree in found.values() for f in per_tree.values()):
            figures.pop("status", None)
    md = header(command_line("regression/regression.py"), trees, args.rounds, time.time() - started)
    if args.short:  # (the promises are of the full runs' sizes)
        md += "--short: fewer images (sync_every_hidden 3,200 at --sync-every 8; the others 1,600).\n\n"
    md += table(ratios, trees, found, unable, failed)
    md += "".join(f"\n- {line}" for line in skips + [f"{t}: {c} failed: {e}" for (t, c), e in failed.items()])
    print("\n" + md, flush=True)
    if args.results_dir:
        result = {"command": command_line("regression/regression.py"), "cpu": cpu_model(), "rounds": records}
        result.update(trees={t.label: t.note for t in trees}, ratios=found, skipped=skips)
        result.update(run_info(host_info(), started))
        result["configs"] = {c: vars(cfgs[c]) for r in ratios for c in (r.a, r.b)}
        stem = results_stem("regression", args.short and "short", args.only and "only-" + "-".join(args.only))
        rounds = args.rounds != (1 if args.short else 3) and f"r{args.rounds}"
        stem = results_stem(stem, rounds, trees[1:] and f"against-{trees[-1].label}")
        Path(args.results_dir).mkdir(parents=True, exist_ok=True)
        write_results(Path(args.results_dir) / stem, result, md)
    return 2 if any(t == trees[0].label for t, _ in failed) else 0


def run(args) -> int:
    trees = [this_tree()]
    if not args.against:
        return measure_all(args, trees)
    with tempfile.TemporaryDirectory(prefix="regression-against-") as folder:
        os.chmod(folder, 0o755)  # (the emulated hosts' ranks run its train.py)
        path = Path(folder) / "tree"
        try:
            trees.append(add_worktree(args.against, path))
            return measure_all(args, trees)
        finally:
            remove_worktree(path)


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.prog = "bench/regression/regression.py"
    ap.add_argument("--against", metavar="COMMIT", help="also measure this commit (a git worktree), side by side")
    ap.add_argument("--only", type=name_list(NAMES, "ratio(s)"), metavar="NAME[,NAME]", help=", ".join(NAMES))
    ap.add_argument("--rounds", type=positive(int), help="rounds, each command once a round (default 3; --short 1)")
    ap.add_argument("--short", action="store_true", help=f"1 round, fewer images, this tree: {', '.join(SHORT)}")
    ap.add_argument("--timeout", type=positive(float), default=TIMEOUT, help=f"s per command (default {TIMEOUT:g})")
    ap.add_argument("--results-dir", help="default bench/results/regression (--short: none, nothing written)")
    args = ap.parse_args(argv)
    if args.short and args.against:
        ap.error("--short measures this tree only; drop --against")
    if args.short and args.only and not set(args.only) <= set(SHORT):
        ap.error(f"--short runs only {', '.join(SHORT)}")
    args.rounds = args.rounds or (1 if args.short else 3)
    if not args.short and not args.results_dir:
        args.results_dir = str(RESULTS / "regression")
    return run_driver(run, args, ap.prog)


if __name__ == "__main__":
    sys.exit(main())
