#!/usr/bin/env python3
"""Emulate a small cluster of servers on one Linux machine, and run train.py (or any command) on it.

    sudo python scripts/cluster.py train --hosts 3 --rate 1gbit -- --epochs 1
    sudo python scripts/cluster.py train --hosts 2 --cpu 1=0.5 -- --epochs 1    # host 1 at half a core
    sudo python scripts/cluster.py exec --hosts 2 -- ip -brief address
    sudo python scripts/cluster.py cleanup

The hosts are scripts/netns.py's network namespaces. Usable both as a module (tests and
benchmarks: ``Cluster``, ``train``, ``cleanup_stale``) and as this command line. The ranks are
watched by the repo's one process supervisor (utils/setup/launch.py): when one fails the others get
--grace seconds, every rank is killed on every way out, and every namespace is removed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from netns import DEFAULT_NICS, GRACE, MAX_RANKS_PER_HOST, Cluster, ClusterError, cleanup_stale

# `x as x`: re-exported for the tests and the benchmarks, which take them from cluster
from netns import NEEDS_ROOT as NEEDS_ROOT
from netns import PREFIX as PREFIX
from netns import TBF_LATENCY as TBF_LATENCY
from netns import parse_rate as parse_rate
from netns import tbf_burst as tbf_burst
from throttle import MIN_FRACTION, CpuQuota, ThrottleError, controller, remove_stale

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from utils.setup.handoff import Handoff  # noqa: E402
from utils.setup.launch import rank_threads, supervise  # noqa: E402


def _run_all(
    cluster: Cluster,
    argvs: list[list[str]],
    timeout: float,
    prefix_output: bool = True,
    grace: float = GRACE,
    cpu: dict[int, tuple[float, float]] | None = None,
) -> int:
    """Start argvs[r] (rank r) on its host, stream output, and supervise (utils.setup.launch.supervise); see train().
    cpu: {host: (fraction of a core, after seconds)}, the CPU quota of that host's ranks (scripts/throttle.py)."""
    out_lock = threading.Lock()

    def pump(rank: int, fd: int) -> None:
        prefix = f"[{cluster.label(rank)}] ".encode()
        with open(fd, "rb") as stream:
            for line in iter(stream.readline, b""):
                with out_lock:
                    sys.stdout.buffer.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                    sys.stdout.flush()

    # the emulated hosts share this machine's cores: torch loads with the ranks' share, as the local
    # launcher's do (the rule each rank would reach by itself), unless the user chose
    count, handoff = rank_threads(len(argvs), Handoff.from_environ())
    threads = dict(handoff.environ({}), OMP_NUM_THREADS=count)
    procs, pumps = [], []
    for r, argv in enumerate(argvs):
        if not prefix_output:
            procs.append(cluster.popen(cluster.host_of(r), argv, env=threads, stdin=subprocess.DEVNULL))
            continue
        # our own pipe, not stdout=PIPE: supervise would read a PIPE to its end, we stream it line by line
        read_end, write_end = os.pipe()
        try:
            procs.append(
                cluster.popen(
                    cluster.host_of(r),
                    argv,
                    env=threads,
                    stdin=subprocess.DEVNULL,
                    stdout=write_end,
                    stderr=subprocess.STDOUT,
                )
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        pumps.append(threading.Thread(target=pump, args=(r, read_end), daemon=True))
        pumps[-1].start()

    first_failure = None

    def announce(rank: int) -> None:
        host = cluster.host_of(rank)
        print(
            f"cluster.py: host{host} ({cluster.nic(host)}){f' rank{rank}' if cluster.ranks_per_host > 1 else ''}"
            f" exited with {procs[rank].returncode}; killing the others in {grace:g}s",
            file=sys.stderr,
            flush=True,
        )

    def watch(procs: list[subprocess.Popen]) -> None:
        nonlocal first_failure
        codes = [p.poll() for p in procs]  # every one, every round (supervise's own poll stops at a live one)
        if first_failure is None:
            first_failure = next((r for r, rc in enumerate(codes) if rc not in (None, 0)), None)
            if first_failure is not None:
                announce(first_failure)

    with throttled(cluster, procs, cpu or {}):
        outcome = supervise(procs, timeout=timeout, grace=grace, poll=0.05, while_running=watch)
    if outcome.timed_out:
        print(f"cluster.py: timeout after {timeout}s; killing all hosts", file=sys.stderr, flush=True)
    elif outcome.killed:  # a rank failed and the grace period ran out
        if first_failure is None:  # (failed and grace ran out between two watches)
            first_failure = outcome.codes.index(outcome.failed)
            announce(first_failure)
        print("cluster.py: grace period over; killing remaining hosts", file=sys.stderr, flush=True)
    for t in pumps:
        t.join(timeout=5)
    if outcome.timed_out:
        return 124
    rc = outcome.codes[first_failure] if first_failure is not None else outcome.failed
    return rc if rc >= 0 else 128 - rc  # killed by signal N -> 128+N


@contextlib.contextmanager
def throttled(cluster: Cluster, procs: list, cpu: dict[int, tuple[float, float]]):
    """Each throttled host's ranks in a CPU quota of its own while the block runs: at once, or
    unlimited until `after` seconds (a timer). On the way out the timers stop and the groups go."""
    with contextlib.ExitStack() as quotas:
        for host, (fraction, after) in sorted(cpu.items()):
            quota = quotas.enter_context(CpuQuota(f"host{host}"))
            quota.set(None if after else fraction)
            for r, p in enumerate(procs):
                if cluster.host_of(r) == host:
                    quota.add(p.pid)
            if after:
                timer = threading.Timer(after, quota.set, (fraction,))
                timer.daemon = True
                timer.start()
                quotas.callback(timer.cancel)
        yield


def cpu_limits(text: str) -> dict[int, tuple[float, float]]:
    """argparse type for --cpu: HOST=FRACTION[@SECONDS],... -> {host: (fraction, seconds)}."""
    limits = {}
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)=([0-9.]+)(?:@([0-9.]+))?", item.strip())
        try:
            host, fraction, after = int(match[1]), float(match[2]), float(match[3] or 0)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(
                f"expected HOST=FRACTION[@SECONDS], e.g. 1=0.5 or 1=0.5@30, got {item!r}"
            ) from None
        if not MIN_FRACTION <= fraction <= 64:
            raise argparse.ArgumentTypeError(
                f"a host's CPU is {MIN_FRACTION:g} to 64 cores, got {fraction:g} for host {host}"
            )
        limits[host] = (fraction, after)
    return limits


def train(
    hosts: int,
    extra_args: list[str],
    rate: str | None = None,
    nics: list[str] | None = None,
    port: int = 29500,
    timeout: float = 600,
    prefix_output: bool = True,
    grace: float = GRACE,
    ranks_per_host: int = 1,
    cpu: dict[int, tuple[float, float]] | None = None,
) -> int:
    """Run train.py on every emulated host, as users would on real servers (K ranks each,
    sharing the host's one NIC, with ranks_per_host=K; cpu: slow hosts, see _run_all).

    Output is streamed per line, prefixed "[host1 ens3] " ("[host1 ens3 rank3] " with several
    ranks per host).  If a rank fails the others get `grace` seconds, then are killed.  Returns
    0 only if every rank returned 0; else the first failing rank's code, or 124 on timeout.
    """
    check_hosts(cpu, hosts)
    with Cluster(hosts, rate=rate, nics=nics, ranks_per_host=ranks_per_host) as c:
        argvs = [c.train_argv(r, port, extra_args) for r in range(c.world_size)]
        return _run_all(c, argvs, timeout, prefix_output, grace, cpu)


def exec_all(
    hosts: int,
    template: list[str],
    rate: str | None = None,
    nics: list[str] | None = None,
    timeout: float = 600,
    prefix_output: bool = True,
    grace: float = GRACE,
    ranks_per_host: int = 1,
    cpu: dict[int, tuple[float, float]] | None = None,
) -> int:
    """Run a command template for every rank at once, on its host (see the CLI's `exec`)."""
    check_hosts(cpu, hosts)
    if len(template) == 1:  # one word: a shell command line, like ssh
        template = ["sh", "-c", template[0]]
    with Cluster(hosts, rate=rate, nics=nics, ranks_per_host=ranks_per_host) as c:
        argvs = []
        for r in range(c.world_size):
            host = c.host_of(r)
            fields = dict(
                rank=r,
                world_size=c.world_size,
                host=host,
                local_rank=r % ranks_per_host,
                addr=c.addr(host),
                addr0=c.addr(0),
                nic=c.nic(host),
            )
            try:
                argvs.append([word.format_map(fields) for word in template])
            except (KeyError, IndexError, ValueError) as e:
                raise ClusterError(
                    f"bad command template ({e!r}); fields: {', '.join(fields)}; write {{{{ }}}} for literal braces"
                ) from None
        return _run_all(c, argvs, timeout, prefix_output, grace, cpu)


def remove_stale_quotas() -> list[str]:
    """CPU groups (--cpu) of runs killed with SIGKILL."""
    try:
        return remove_stale(controller()[0])
    except ThrottleError:
        return []


def check_hosts(cpu: dict | None, hosts: int) -> None:
    beyond = sorted(h for h in cpu or {} if h >= hosts)
    if beyond:
        raise ClusterError(f"--cpu names host {beyond[0]}, but the hosts are 0..{hosts - 1}")


# -- CLI --------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"cluster.py: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def ranks_per_host(text: str) -> int:
    """argparse type for --ranks-per-host: a whole number 1..MAX_RANKS_PER_HOST."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= value <= MAX_RANKS_PER_HOST:
        raise argparse.ArgumentTypeError(f"must be 1..{MAX_RANKS_PER_HOST}, got {text!r}")
    return value


class _Signalled(BaseException):
    """Raised in the main thread on SIGTERM/SIGHUP so `with Cluster` tears down."""


def _on_signal(signum, frame):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # don't let a second signal interrupt teardown
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    raise _Signalled(signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    ap = _Parser(prog="cluster.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    for name, help_ in (
        ("train", "run train.py on every host: cluster.py train --hosts 3 -- --epochs 1"),
        (
            "exec",
            "run a command on every host (once per rank); template fields {rank} "
            "{world_size} {host} {local_rank} {addr} {addr0} {nic}: "
            "cluster.py exec --hosts 2 -- hostname -I",
        ),
    ):
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--hosts", type=int, required=True)
        p.add_argument(
            "--ranks-per-host",
            type=ranks_per_host,
            default=1,
            metavar="K",
            help="ranks on each host, sharing its one NIC (default 1); rank r runs on host r // K",
        )
        p.add_argument("--rate", help="egress cap per host, tc syntax, e.g. 1gbit, 200mbit")
        p.add_argument("--nics", help=f"comma separated NIC names (default {','.join(DEFAULT_NICS)})")
        p.add_argument(
            "--cpu",
            type=cpu_limits,
            metavar="HOST=FRACTION[@SECONDS]",
            help="slow hosts: their ranks get at most FRACTION of a core (a cgroup CPU quota), from the start "
            "or from SECONDS on; comma separated, e.g. 1=0.5 or 1=0.5@30,2=0.25",
        )
        p.add_argument("--timeout", type=float, default=600, help="hard limit in seconds (exit 124)")
        p.add_argument("--grace", type=float, default=GRACE, help="seconds the others get after a failure")
        if name == "train":
            p.add_argument("--port", type=int, default=29500)
    sub.add_parser("cleanup", help="remove leftovers of crashed runs")
    args = ap.parse_args(argv)
    if args.cmd == "exec" and not rest:
        ap.error("exec needs a command after --")

    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, _on_signal)
    try:
        if args.cmd == "cleanup":
            for name in cleanup_stale() + remove_stale_quotas():
                print(f"removed {name}")
            return 0
        nics = args.nics.split(",") if args.nics else None
        if args.cmd == "train":
            return train(
                args.hosts,
                rest,
                args.rate,
                nics,
                args.port,
                args.timeout,
                grace=args.grace,
                ranks_per_host=args.ranks_per_host,
                cpu=args.cpu,
            )
        return exec_all(
            args.hosts,
            rest,
            args.rate,
            nics,
            args.timeout,
            grace=args.grace,
            ranks_per_host=args.ranks_per_host,
            cpu=args.cpu,
        )
    except (ClusterError, ThrottleError) as e:
        print(f"cluster.py: {e}", file=sys.stderr)
        return 2
    except _Signalled as e:
        print(f"cluster.py: got signal {e.args[0]}; torn down", file=sys.stderr)
        return 128 + e.args[0]


if __name__ == "__main__":
    sys.exit(main())
