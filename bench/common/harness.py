"""What every benchmark shares: the command line's option groups and their checks, a world of rank
processes (each driver starts its own file with --worker, supervised by utils.setup.launch.supervise), the
emulated cluster, the rotation of configurations and the results files (bench/common/NOTES.md, "How
they run"). bench/common/stats.py has the load check and the paired statistics.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
sys.path[:0] = [str(REPO), str(REPO / "scripts"), str(REPO / "tests" / "support")]  # utils/, netns.py, forkserver.py
import forkserver  # noqa: E402  (tests/support/forkserver.py: the loopback workers are forked)
import netns  # noqa: E402
import throttle  # noqa: E402, F401  (scripts/throttle.py: CPU quotas, for bench/balance/balance.py)
from stats import LoadWatch, quiet  # noqa: E402  (bench/common/stats.py: the load check, the paired statistics)

from utils.errors import UsageError  # noqa: E402
from utils.learn.model import Net, parameter_vector  # noqa: E402
from utils.setup import fork  # noqa: E402
from utils.setup.launch import free_port, kill, supervise  # noqa: E402
from utils.store.files import write_file  # noqa: E402

GRACE = 5.0  # seconds the other ranks get to notice a failed one before they are killed
POLL = 0.1  # seconds between looks at a running world
OP_TIMEOUT = 120.0  # s for any single send/recv/collective of gloo, as train.py's default


def numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


MODEL_NUMEL = numel(Net())  # the gradient every benchmark sums: utils/learn/model.Net's, however it changes


# --------------------------------------------------------------------------- command line
class LaunchError(RuntimeError):
    """A world of ranks failed or timed out; the message holds each rank's last stderr lines."""


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr and exit code 2, as train.py does (no usage dump)."""

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def bench_parser(doc: str) -> OneLineParser:
    """A benchmark's command line: its docstring's first paragraph as --help's description, the whole as its epilog."""
    raw = argparse.RawDescriptionHelpFormatter
    return OneLineParser(description=doc.split("\n\n")[0], formatter_class=raw, epilog=doc)


def argument_type(parse):
    """An argparse type from parse(text), which raises ValueError with the message to show."""

    def convert(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def number_list(kind):
    """argparse type: "2,3,4" -> [2, 3, 4], with a clear error for anything else."""

    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",")]
        except ValueError:
            whole = "whole " if kind is int else ""
            raise ValueError(f"expected comma-separated {whole}numbers, got {text!r}") from None

    return argument_type(parse)


def name_list(choices, what: str = "algorithm(s)"):
    """argparse type: "a,b" -> ["a", "b"], each one of `choices`."""

    def parse(text: str) -> list[str]:
        names = text.split(",")
        bad = [x for x in names if x not in choices]
        if bad or not names:
            raise ValueError(f"unknown {what} {bad}; choose from {', '.join(choices)}")
        return names

    return argument_type(parse)


def positive(kind):
    """argparse type: a finite number > 0 of `kind`."""

    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"must be > 0, got {text}")
        return v

    return argument_type(parse)


def at_least(low: int, why: str = ""):
    """argparse type: a whole number >= low."""

    def parse(text):
        if int(text) < low:
            raise ValueError(f"must be >= {low}{why}, got {text}")
        return int(text)

    return argument_type(parse)


def rate_list(text: str) -> list[str]:
    """tc-style rates ('200mbit,1gbit'; '10mbps' = megaBYTES/s), each checked (scripts/netns.py)."""
    rates = [x for x in text.split(",") if x]
    if not rates:
        raise argparse.ArgumentTypeError("--rates needs at least one rate")
    return [checked_rate(rate) for rate in rates]


def checked_rate(rate: str) -> str:
    parse_rate(rate)
    return rate


def parse_rate(rate: str) -> int:
    """tc-style rate -> bits per second (argparse's error for a bad one)."""
    try:
        return netns.parse_rate(rate)
    except netns.ClusterError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_options(ap, world_sizes="2,4", warmup=None, iters=None, algorithms=None, powersgd=False, seed=1):
    """The options several benchmarks share: --world-sizes, --seed; with warmup/iters their defaults
    (rounds, or repetitions, to discard and to time); with algorithms (choices, default) --algorithms
    and --ranks-per-host; with powersgd PowerSGD's rank and warm-up (ours and DDP's hook's)."""
    from utils.comm.compress import DEFAULT_POWERSGD_RANK, DEFAULT_POWERSGD_WARMUP

    ap.add_argument("--world-sizes", default=world_sizes, type=number_list(int), help=f"default {world_sizes}")
    if warmup is not None:
        ap.add_argument("--warmup", type=at_least(0), default=warmup, help=f"discarded first (default {warmup})")
        ap.add_argument("--iters", type=positive(int), default=iters, help=f"timed (default {iters})")
    if algorithms is not None:
        choices, default = algorithms
        ap.add_argument("--algorithms", default=default, type=name_list(choices), help=f"from {','.join(choices)}")
        per_host = "K ranks per host, sharing its card (default 1)"
        ap.add_argument("--ranks-per-host", type=int, default=1, metavar="K", help=per_host)
    if powersgd:
        ap.add_argument("--powersgd-rank", type=positive(int), default=DEFAULT_POWERSGD_RANK, help="ours and DDP's")
        two = at_least(2, " (DDP's PowerSGD hook needs 2 plain steps first)")
        help = f"plain steps before PowerSGD, ours and DDP's (default {DEFAULT_POWERSGD_WARMUP}; >= 2)"
        ap.add_argument("--powersgd-warmup", type=two, default=DEFAULT_POWERSGD_WARMUP, help=help)
    ap.add_argument("--seed", type=int, default=seed)


def add_link_options(ap, default: str, one_rate: bool = False):
    """--loopback, or the emulated cluster's per-host egress caps: --rates A,B (alias --rate), or with
    one_rate --rate R (the default) or --rates A,B, not both."""
    ap.add_argument("--loopback", action="store_true", help="all ranks on 127.0.0.1 (default: emulated cluster)")
    caps = "per-host egress caps, tc syntax; the whole plan once per rate"
    if not one_rate:
        return ap.add_argument("--rates", "--rate", default=default, type=rate_list, help=f"{caps} (default {default})")
    link = ap.add_mutually_exclusive_group()
    link.add_argument("--rate", default=default, type=checked_rate, help=f"per-host egress cap (default {default})")
    link.add_argument("--rates", type=rate_list, help=caps)


def add_world_options(ap, results: str, per: str = "world") -> None:
    """The options every benchmark ends with: the hard timeout per world, where its results go, and
    the hidden ones its driver starts its own ranks with (--worker --rank R --config FILE). Results go
    to bench/results/<results>/ unless --results-dir says otherwise."""
    ap.add_argument("--timeout", type=float, default=0, help=f"hard limit per {per} in s (default: from the plan)")
    ap.add_argument("--results-dir", default=str(RESULTS / results))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)


def check_options(ap, args) -> None:
    """What add_options' and add_link_options' values must agree on, checked once for every benchmark."""
    per_host = getattr(args, "ranks_per_host", 1)
    if not 1 <= per_host <= netns.MAX_RANKS_PER_HOST:
        ap.error(f"--ranks-per-host must be 1..{netns.MAX_RANKS_PER_HOST}, got {per_host}")
    if any(n < 1 or n * per_host < 2 for n in args.world_sizes):
        ap.error("world sizes must be >= 2" if per_host == 1 else "world sizes (hosts) must be >= 1")
    if "rates" in vars(args):
        args.rates = args.rates or [args.rate]  # (time_to_accuracy.py: --rate R, or --rates)
        if len(set(args.rates)) != len(args.rates):
            ap.error("--rates: a rate named twice")


# --------------------------------------------------------------------------- worlds
@contextlib.contextmanager
def emulated_cluster(rate: str | None, hosts: int, ranks_per_host: int = 1):
    """An emulated cluster of `hosts` hosts capped at `rate` (scripts/netns.py), or None for
    loopback (rate None). Leaving it tears every namespace down, also on errors."""
    if not rate:
        yield None
        return
    with netns.Cluster(hosts=hosts, rate=rate, ranks_per_host=ranks_per_host) as cl:
        nics = ", ".join(f"{cl.addr(r)}/{cl.nic(r)}" for r in range(cl.hosts))
        print(f"# cluster {rate}: {cl.hosts} hosts {nics}", flush=True)
        yield cl


@contextlib.contextmanager
def worlds_dir(prefix: str):
    """A temporary folder for the worlds' configurations, results and logs (readable in the namespaces)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        os.chmod(tmp, 0o755)
        yield Path(tmp)


def world_config(cl, base: int, i: int, world_size: int) -> dict:
    """What every world's ranks start with: the size, rank 0's rendezvous address and the operations'
    timeout. The port: a fixed one inside the emulated cluster (its namespaces are ours alone), a free
    one on loopback."""
    port = base + 10 * i + os.getpid() % 7 if cl else free_port()
    host0 = cl.addr(0) if cl else "127.0.0.1"
    return {"world_size": world_size, "init_method": f"tcp://{host0}:{port}", "op_timeout": OP_TIMEOUT}


def sum_seconds(n: int, rate_bits: float | None, numel: int) -> float:
    """A generous time (twice the slowest's) for one gradient sum of `numel` floats among n ranks."""
    return 2 * (2 * numel * 4) / ((rate_bits or 8e9) / 8) * max(1.0, (n - 1) / 2)


def launch_world(script: str, cfg: dict, cl, tmp: Path, tag: str, timeout: float, what: str, ok_codes=(0,), per_host=1):
    """One world: ranks 0..N-1 of `script --worker --rank R --config CONFIG` (cfg plus "out", where rank 0 writes
    its results), on emulated host r // per_host of `cl` (GLOO_SOCKET_IFNAME its NIC) or on loopback
    (per_host > 1 faked: the config's "host_ids" name each rank's host), until all have exited. Rank 0's
    stdout is ours; every rank's stderr goes to tmp/rank<R>-<tag>.log. A rank exiting with a code not in
    ok_codes, or the timeout, stops the world: LaunchError (naming `what`, with each rank's stderr tail).
    Returns rank 0's results with "load": what else used the machine meanwhile (warned about when not
    quiet).
    """
    config, out_path = tmp / f"config-{tag}.json", tmp / f"result-{tag}.json"
    host_ids = [str(r // per_host) for r in range(cfg["world_size"])] if not cl and per_host > 1 else None
    config.write_text(json.dumps({**cfg, "out": str(out_path), "host_ids": host_ids}))
    watch, procs, logs = LoadWatch(), [], []
    log_paths = [tmp / f"rank{r}-{tag}.log" for r in range(cfg["world_size"])]
    try:
        for r, path in enumerate(log_paths):
            argv = [sys.executable, "-u", script, "--worker", "--rank", str(r), "--config", str(config)]
            host = r // per_host
            env = {"GLOO_SOCKET_IFNAME": cl.nic(host) if cl else "lo", "OMP_NUM_THREADS": "1"}
            env.update(PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR")
            logs.append(open(path, "wb"))
            kw = dict(stdin=subprocess.DEVNULL, stdout=None if r == 0 else logs[-1], stderr=logs[-1], cwd=REPO)
            if cl:
                procs.append(cl.popen(host, argv, env=env, **kw))
            else:
                procs.append(start_loopback(argv, {**os.environ, **env}, kw, f"worker {r}"))
        outcome = supervise(procs, timeout=timeout, grace=GRACE, poll=POLL, ok_codes=ok_codes, while_running=watch.note)
    finally:
        for p in procs:  # a rank that failed to start, or Ctrl-C while they start
            kill(p)
        for log in logs:
            log.close()
    if outcome.timed_out:
        raise LaunchError(f"{what}: timed out after {timeout:.0f}s (--timeout); killed all ranks")
    if any(c not in ok_codes for c in outcome.codes):
        tails = []
        for r, path in enumerate(log_paths):
            text = "\n".join(path.read_text(errors="replace").strip().splitlines()[-15:])
            tails.append(f"--- rank {r} (exit {outcome.codes[r]}), last lines of its stderr:\n{text}")
        raise LaunchError(f"{what}: ranks exited with {outcome.codes}\n" + "\n".join(tails))
    if not out_path.exists():
        raise LaunchError(f"{what}: the ranks exited without writing {out_path}")
    raw = json.loads(out_path.read_text())
    raw["load"] = load = watch.result(procs)
    if not quiet(load):
        busy = f"{load['busy_cores']:.2f} of {os.cpu_count()} cores busy, our ranks {load['ours_cores']:.2f}"
        others = f"other processes {load['foreign_cpu_cores']:.2f} ({', '.join(load['foreign_top'])})"
        busy = f"the machine was busy besides this benchmark: {busy}, {others}"
        print(f"  WARNING {what}: {busy}; timings may be inflated", flush=True)
    return raw


def start_loopback(argv: list, env: dict, kw: dict, name: str):
    """A loopback worker, forked by this driver's fork server (torch loaded once for all), else exec'd."""
    key = tuple(sorted(fork.at_load(env).items()))
    if key not in _fork_servers or not _fork_servers[key].alive():
        _fork_servers[key] = forkserver.ForkServer(env)
    if fork.forkable(env, _fork_servers[key].env):
        return _fork_servers[key].popen(argv, env=env, start_new_session=True, name=name, **kw)
    return subprocess.Popen(argv, env=env, start_new_session=True, **kw)


_fork_servers = {}  # the variables torch reads at load -> this driver's ForkServer


def run_driver(driver, args, prog: str) -> int:
    """driver(args), where SIGTERM, SIGHUP and a second Ctrl-C unwind like the first Ctrl-C, so every
    rank is killed and the cluster torn down on the way out; a failed world or cluster is one line
    on stderr and exit code 2."""

    def on_term(signum, frame):
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut teardown short
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGINT too: shells start background jobs ignoring it
        signal.signal(sig, on_term)
    try:
        return driver(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; killed all ranks", file=sys.stderr)
        return 130
    except (LaunchError, netns.ClusterError, UsageError) as e:  # UsageError: a results file not written
        kind = "FAILED" if isinstance(e, LaunchError) else "error" if isinstance(e, UsageError) else "cluster"
        print(f"{prog}: {kind}: {e}", file=sys.stderr)
        return 2


# --------------------------------------------------------------------------- workers
def start_worker(args, deterministic: bool = True):
    """A rank's start: its world's configuration (--config), 1 torch thread (the ranks share this
    machine's cores, as train.py's ranks do), deterministic algorithms, the gloo process group.
    Returns (the configuration, say()), which prints on rank 0."""
    import torch
    import torch.distributed as dist

    cfg = json.loads(Path(args.config).read_text())
    torch.set_num_threads(1)
    if deterministic:
        from utils.learn.model import use_deterministic_algorithms

        use_deterministic_algorithms()
    timeout = datetime.timedelta(seconds=cfg["op_timeout"])
    world = {"rank": args.rank, "world_size": cfg["world_size"], "timeout": timeout}
    dist.init_process_group("gloo", init_method=cfg["init_method"], **world)
    return cfg, (lambda *a: print(*a, flush=True)) if args.rank == 0 else (lambda *a: None)


def end_worker(cfg: dict, rank: int, out: dict) -> None:
    """A rank's end: rank 0 writes the world's results `out` for the driver, then all leave together."""
    import torch.distributed as dist

    if rank == 0:
        write_file(Path(cfg["out"]), json.dumps(out).encode())
    dist.barrier()
    dist.destroy_process_group()


def digest(model) -> str:
    """sha256 of a model's parameters: equal on every rank iff the ranks hold the same bits."""
    import hashlib

    flat = parameter_vector(model)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def rotated(items: list, rnd: int) -> list:
    """items, starting at rnd's place: the order of round `rnd`, so that no configuration always goes
    first (or right after a given other) and a slow minute hits them all alike."""
    k = rnd % len(items) if items else 0
    return items[k:] + items[:k]


def pick(obj, names: str) -> dict:
    """{name: obj.name (or obj[name], of a dict)} for the space-separated names: the options a
    world's ranks are given, and what they take of them."""
    return {name: obj[name] if isinstance(obj, dict) else getattr(obj, name) for name in names.split()}


# --------------------------------------------------------------------------- results
def results_stem(*parts) -> str:
    """A results file's name: the benchmark and mode, then every way this run differs from the
    script's default plan (None or '' where it does not), so that a partial or different run never
    overwrites the full one's files."""
    return "-".join(str(p) for p in parts if p)


def differences(args, defaults: dict, spelt: dict) -> list:
    """For a results_stem: spelt[name] (a format, or a function of the value) for each option whose
    value differs from defaults[name] (an option without a default: any value it was given)."""
    out = []
    for name, text in spelt.items():
        value = getattr(args, name)
        changed = value != defaults.get(name)
        out.append((text(value) if callable(text) else text.format(value)) if changed else None)
    return out


def command_line(script: str) -> str:
    """The command that made a results file, as its .md shows it."""
    return " ".join(["python3", f"bench/{script}"] + sys.argv[1:])


def host_info() -> dict:
    import torch

    versions = dict(python=platform.python_version(), torch=torch.__version__, kernel=platform.release())
    return dict(node=platform.node(), cpus=os.cpu_count(), **versions)


def run_info(host: dict, started: float) -> dict:
    """The results' host, start (ISO time) and seconds so far."""
    at = datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds")
    return {"host": host, "started": at, "seconds": round(time.time() - started, 1)}


def figure(rows: int, cols: int, figsize: tuple, **kw):
    """A matplotlib figure of rows x cols panels (axes[i][j], even for one), drawn off-screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=figsize, squeeze=False, **kw)


def png_of(fig, dpi: int = 100) -> bytes:
    """A matplotlib figure as PNG bytes (then closed), for write_results."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


def write_results(stem: Path, result: dict, md: str, png: bytes | None = None) -> None:
    """stem.json, stem.md and stem.png, each written atomically (a reader never sees half a file)."""
    write_file(f"{stem}.json", (json.dumps(result, indent=1) + "\n").encode())
    write_file(f"{stem}.md", md.encode())
    if png is not None:
        write_file(f"{stem}.png", png)
