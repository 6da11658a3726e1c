"""What every benchmark shares; each script (allreduce.py, train_step.py, time_to_accuracy.py) is a
plugin that brings only its worker, its configurations and its summary.

    command line   OneLineParser, number_list, positive, parse_rate
    worlds         emulated_cluster, world_port, launch_world (run_world + the load check), run_driver
    workers        start_worker, digest, rotated
    statistics     sign_test_p, p_text, paired_ratios, compare, ratios_to_gloo, quantile, median_or_none
    results        results_stem, command_line, host_info, write_results, png_of
    MODEL_NUMEL    the trainer's parameter count, counted from utils/model.Net itself

A benchmark's driver starts N real rank processes of its own file (`--worker --rank R --config
FILE`), one world at a time, and reads rank 0's result file; the ranks are supervised by
utils.launch.supervise, the repository's one process supervisor, so a failed rank stops its world
and nothing outlives the driver.
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
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
sys.path[:0] = [str(REPO), str(REPO / "scripts")]  # utils/ (ranks), scripts/cluster.py (driver)
import cluster  # noqa: E402

from utils.errors import UsageError  # noqa: E402
from utils.files import write_file  # noqa: E402
from utils.launch import free_port, kill, supervise  # noqa: E402
from utils.model import Net  # noqa: E402

GRACE = 5.0  # seconds the other ranks get to notice a failed one before they are killed
POLL = 0.1  # seconds between looks at a running world
QUIET_FOREIGN_CORES = 0.1  # more than this used by other processes: the timings may be inflated
QUIET_EXTRA_BUSY_CORES = 0.6  # nor this much CPU busy beyond our ranks (kernel networking included)


def numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


MODEL_NUMEL = numel(Net())  # the gradient every benchmark sums: utils/model.Net's, however it changes


# --------------------------------------------------------------------------- command line
class LaunchError(RuntimeError):
    """A world of ranks failed or timed out; the message holds each rank's last stderr lines."""


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr and exit code 2, as train.py does (no usage dump)."""

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def bench_parser(doc: str) -> OneLineParser:
    """A benchmark's command line: its docstring's first paragraph as the description, the whole
    docstring as --help's epilog."""
    return OneLineParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc
    )


def add_world_options(ap, per: str = "world") -> None:
    """The options every benchmark ends with: the hard timeout per world, where its results go, and
    the hidden ones its driver starts its own ranks with (--worker --rank R --config FILE)."""
    ap.add_argument("--timeout", type=float, default=0, help=f"hard limit per {per} in s (default: from the plan)")
    ap.add_argument("--results-dir", default=str(RESULTS))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)


def number_list(kind):
    """argparse type: "2,3,4" -> [2, 3, 4], with a clear error for anything else."""

    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {'whole ' if kind is int else ''}numbers, got {text!r}"
            ) from None

    return parse


def positive(kind):
    """argparse type: a finite number > 0 of `kind`."""

    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (v > 0 and math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return v

    return parse


def parse_rate(rate: str) -> int:
    """tc-style rate ('200mbit', '1gbit', '10mbps' = megaBYTES/s) -> bits per second (for argparse)."""
    try:
        return cluster.parse_rate(rate)
    except cluster.ClusterError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# --------------------------------------------------------------------------- worlds
@contextlib.contextmanager
def emulated_cluster(rate: str | None, hosts: int, ranks_per_host: int = 1):
    """An emulated cluster of `hosts` hosts capped at `rate` (scripts/cluster.py), or None for
    loopback (rate None). Leaving it tears every namespace down, also on errors."""
    if not rate:
        yield None
        return
    with cluster.Cluster(hosts=hosts, rate=rate, ranks_per_host=ranks_per_host) as cl:
        print(
            f"# cluster {rate}: {cl.hosts} hosts {', '.join(f'{cl.addr(r)}/{cl.nic(r)}' for r in range(cl.hosts))}",
            flush=True,
        )
        yield cl


def world_port(cl, base: int, i: int) -> int:
    """Rank 0's rendezvous port for the i-th world: a fixed one inside the emulated cluster (its
    namespaces are ours alone), a free one on loopback."""
    return base + 10 * i + os.getpid() % 7 if cl else free_port()


def run_world(
    script: str,
    n: int,
    config: Path,
    cl,
    log_name: str,
    timeout: float,
    what: str,
    ok_codes=(0,),
    env: dict | None = None,
    while_running=None,
    ranks_per_host: int = 1,
) -> list[subprocess.Popen]:
    """Run ranks 0..n-1 of `script --worker --rank R --config CONFIG` until all have exited.

    With a cluster `cl` (scripts/cluster.py) rank r runs on emulated host r // ranks_per_host with
    GLOO_SOCKET_IFNAME set to its NIC; without, on loopback, where ranks_per_host > 1 fakes the
    hosts for utils/comm/hierarchical.py through RING_HOST_ID. Rank 0's stdout is ours; every rank's
    stderr (and the other ranks' stdout) goes to config's folder / log_name.format(rank=r).
    utils.launch.supervise waits: if a rank exits with a code not in ok_codes, the others get GRACE
    seconds, then are killed, and every rank is killed on every way out. `while_running(procs)` is
    called about every POLL s. Returns the processes; raises LaunchError (naming `what`) on a
    timeout or a failed rank, with each rank's stderr tail.
    """
    procs, logs = [], []
    log_paths = [config.parent / log_name.format(rank=r) for r in range(n)]
    try:
        for r in range(n):
            argv = [sys.executable, "-u", script, "--worker", "--rank", str(r), "--config", str(config)]
            host = r // ranks_per_host
            rank_env = {
                "GLOO_SOCKET_IFNAME": cl.nic(host) if cl else "lo",
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                **({} if cl or ranks_per_host == 1 else {"RING_HOST_ID": str(host)}),
                **(env or {}),
            }
            log = open(log_paths[r], "wb")
            logs.append(log)
            kw = dict(stdin=subprocess.DEVNULL, stdout=None if r == 0 else log, stderr=log, cwd=REPO)
            if cl:
                procs.append(cl.popen(host, argv, env=rank_env, **kw))
            else:
                procs.append(subprocess.Popen(argv, env={**os.environ, **rank_env}, start_new_session=True, **kw))
        outcome = supervise(
            procs, timeout=timeout, grace=GRACE, poll=POLL, ok_codes=ok_codes, while_running=while_running
        )
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
            text = path.read_text(errors="replace").strip().splitlines()
            tails.append(f"--- rank {r} (exit {outcome.codes[r]}), last lines of its stderr:\n" + "\n".join(text[-15:]))
        raise LaunchError(f"{what}: ranks exited with {outcome.codes}\n" + "\n".join(tails))
    return procs


def launch_world(
    script: str,
    n: int,
    cfg: dict,
    cl,
    tmp: Path,
    tag: str,
    timeout: float,
    what: str,
    ok_codes=(0,),
    ranks_per_host: int = 1,
) -> dict:
    """One world: write `cfg` (plus "out", where rank 0 writes its results) to tmp, run its n ranks
    (run_world), and return rank 0's results with "load": what else used the machine meanwhile
    (a warning is printed when it was not quiet)."""
    cfg_path, out_path = tmp / f"config-{tag}.json", tmp / f"result-{tag}.json"
    cfg_path.write_text(json.dumps({**cfg, "out": str(out_path)}))
    watch = LoadWatch()
    procs = run_world(
        script,
        n,
        cfg_path,
        cl,
        f"rank{{rank}}-{tag}.log",
        timeout,
        what,
        ok_codes=ok_codes,
        env={"TORCH_CPP_LOG_LEVEL": "ERROR"},
        while_running=watch.note,
        ranks_per_host=ranks_per_host,
    )
    if not out_path.exists():
        raise LaunchError(f"{what}: the ranks exited without writing {out_path}")
    raw = json.loads(out_path.read_text())
    raw["load"] = load = watch.result(procs)
    if not quiet(load):
        print(
            f"  WARNING {what}: the machine was busy besides this benchmark: {load['busy_cores']:.2f} of "
            f"{os.cpu_count()} cores busy, our ranks {load['ours_cores']:.2f}, other processes "
            f"{load['foreign_cpu_cores']:.2f} ({', '.join(load['foreign_top'])}); timings may be inflated",
            flush=True,
        )
    return raw


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
    except LaunchError as e:
        print(f"{prog}: FAILED: {e}", file=sys.stderr)
        return 2
    except cluster.ClusterError as e:
        print(f"{prog}: cluster: {e}", file=sys.stderr)
        return 2
    except UsageError as e:  # a results file that could not be written (a full disk)
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


# --------------------------------------------------------------------------- workers
def start_worker(cfg: dict, rank: int, deterministic: bool = True):
    """A rank's start: 1 torch thread (the ranks share this machine's cores, as train.py's ranks
    do), deterministic algorithms, the gloo process group. Returns say(), which prints on rank 0."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if deterministic:
        from utils.model import use_deterministic_algorithms

        use_deterministic_algorithms()
    dist.init_process_group(
        "gloo",
        init_method=cfg["init_method"],
        rank=rank,
        world_size=cfg["world_size"],
        timeout=datetime.timedelta(seconds=cfg["op_timeout"]),
    )
    return (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)


def digest(model) -> str:
    """sha256 of a model's parameters: equal on every rank iff the ranks hold the same bits."""
    import hashlib

    import torch

    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def rotated(items: list, rnd: int) -> list:
    """items, starting at rnd's place: the order of round `rnd`, so that no configuration always goes
    first (or right after a given other) and a slow minute hits them all alike."""
    k = rnd % len(items) if items else 0
    return items[k:] + items[:k]


# --------------------------------------------------------------------------- other processes' load
def proc_table() -> dict[int, tuple[int, int, str]]:
    """{pid: (parent pid, utime + stime clock ticks, command name)} of every process now."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                head, tail = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)
                fields = tail.split()
                out[int(d)] = (int(fields[1]), int(fields[11]) + int(fields[12]), head.split("(", 1)[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def descendants(pids: set[int]) -> set[int]:
    """pids and all their descendants (ranks run under `ip netns exec`)."""
    parent = {pid: ppid for pid, (ppid, _, _) in proc_table().items()}
    out, grew = set(pids), True
    while grew:
        new = {p for p, pp in parent.items() if pp in out and p not in out}
        out |= new
        grew = bool(new)
    return out


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def cpu_snapshot() -> dict:
    """Every process's CPU ticks, /proc/stat's busy and total ticks, our reaped children's CPU seconds."""
    cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "procs": proc_table(),
        "busy": sum(cpu) - cpu[3] - cpu[4],
        "total": sum(cpu),
        "children": ru.ru_utime + ru.ru_stime,
        "t": time.monotonic(),
        "loadavg": loadavg(),
    }


class LoadWatch:
    """How busy the machine was besides one world's ranks, from its start to result() (after the
    ranks were reaped). On a shared 2-core machine this says whether a run's timings can be trusted.
    note(procs), called while they run, learns the ranks' descendants (about once a second)."""

    def __init__(self):
        self.before, self.ours, self.noted = cpu_snapshot(), set(), 0.0

    def note(self, procs) -> None:
        if time.monotonic() - self.noted >= 1.0:
            self.ours |= descendants({p.pid for p in procs})
            self.noted = time.monotonic()

    def result(self, procs) -> dict:
        """foreign_cpu_cores: other processes alive at the end (ones that came and went are missed);
        busy_cores: all CPUs, kernel networking included; ours_cores: our ranks."""
        before, after = self.before, cpu_snapshot()
        ours = self.ours | {p.pid for p in procs}
        hz, wall = os.sysconf("SC_CLK_TCK"), max(after["t"] - before["t"], 1e-9)
        used = sorted(
            (
                (t - before["procs"].get(pid, (0, 0, ""))[1], name, pid)
                for pid, (_, t, name) in after["procs"].items()
                if pid not in ours and pid != os.getpid()
            ),
            reverse=True,
        )
        used = [u for u in used if u[0] > 0]
        return {
            "foreign_cpu_cores": round(sum(u[0] for u in used) / hz / wall, 2),
            "foreign_top": [f"{name}[{pid}] {d / hz / wall:.2f}" for d, name, pid in used[:4]],
            "busy_cores": round(
                (after["busy"] - before["busy"]) / max(after["total"] - before["total"], 1) * (os.cpu_count() or 1), 2
            ),
            "ours_cores": round((after["children"] - before["children"]) / wall, 2),
            "loadavg_before": before["loadavg"],
            "loadavg_after": after["loadavg"],
            "seconds": round(wall, 1),
        }


def quiet(load: dict) -> bool:
    """True if nothing but our ranks used the machine's CPUs to speak of."""
    return (
        load["foreign_cpu_cores"] <= QUIET_FOREIGN_CORES
        and load["busy_cores"] - load["ours_cores"] <= QUIET_EXTRA_BUSY_CORES
    )


# --------------------------------------------------------------------------- statistics
def sign_test_p(faster: int, total: int) -> float:
    """Two-sided sign test: how likely a split at least this uneven is if neither side is faster.

    Paired repetitions ran side by side, so each is a coin toss under "no difference"; p < 0.05
    means the difference is real, p above it means the runs cannot tell the two apart.
    """
    if total == 0:
        return 1.0
    k = min(faster, total - faster)
    return min(1.0, 2 * sum(math.comb(total, i) for i in range(k + 1)) / 2**total)


def p_text(p: float) -> str:
    """A sign test's p for a report line: small ones as 'p<0.001', not as a rounded 'p=0.00'."""
    return "p<0.001" if p < 0.001 else f"p={p:.3f}" if p < 0.01 else f"p={p:.2f}"


def paired_ratios(a: list[float], b: list[float]) -> list[float]:
    """a's times over b's, round by round: both ran in the same round, under the same load, so
    slow drifts of the machine cancel."""
    return [x / y for x, y in zip(a, b)]


def compare(a: list[float], b: list[float], bound: float) -> dict:
    """a's times against b's (paired, same rounds): the medians' ratio, the paired median, the rounds
    a was faster in and the sign test. PASS only if both ratios are within `bound`: on a shared
    machine the two can differ by 5-10%, and either alone can flatter."""
    import statistics

    paired = paired_ratios(a, b)
    ratio, pm = statistics.median(a) / statistics.median(b), statistics.median(paired)
    faster = sum(x < 1 for x in paired)
    return {
        "status": "PASS" if max(ratio, pm) <= bound else "MISS",
        "ratio": ratio,
        "paired_median_ratio": pm,
        "bound": bound,
        "rounds_faster": faster,
        "rounds": len(paired),
        "sign_test_p": sign_test_p(faster, len(paired)),
    }


def ratios_to_gloo(results: list[dict], reference: str = "gloo") -> dict:
    """{(N, size, algorithm): [time / gloo's time, per repetition]} for all-reduce results rows
    (bench/allreduce.py) that ran side by side with gloo (or `reference`), the same number of
    repetitions."""
    gloo = {(r["world_size"], r["size"]): r["times_ms"] for r in results if r["algorithm"] == reference}
    out = {}
    for r in results:
        ref = gloo.get((r["world_size"], r["size"]))
        if r["algorithm"] != reference and ref and len(ref) == len(r["times_ms"]):
            out[r["world_size"], r["size"], r["algorithm"]] = paired_ratios(r["times_ms"], ref)
    return out


def quantile(xs: list[float], f: float) -> float:
    """Quantile f of xs (linear interpolation)."""
    s, i = sorted(xs), f * (len(xs) - 1)
    lo = math.floor(i)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (i - lo)


def median_or_none(xs, scale=1.0) -> float | None:
    """The median of the known values of xs, times scale; None if none is known."""
    import statistics

    xs = [x for x in (xs or []) if x is not None]
    return statistics.median(xs) * scale if xs else None


def fmt(x, spec="{:.2f}", none="-"):
    return none if x is None else spec.format(x)


# --------------------------------------------------------------------------- results
def results_stem(*parts) -> str:
    """A results file's name: the benchmark and mode, then every way this run differs from the
    script's default plan (None or '' where it does not), so that a partial or different run never
    overwrites the full one's files."""
    return "-".join(str(p) for p in parts if p)


def command_line(script: str) -> str:
    """The command that made a results file, as its .md shows it."""
    return " ".join(["python3", f"bench/{script}"] + sys.argv[1:])


def host_info() -> dict:
    import torch

    return {
        "node": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kernel": platform.release(),
    }


def started_at(started: float) -> str:
    return datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds")


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
