#!/usr/bin/env python3
"""Emulate a small cluster of servers on one Linux machine.

Users run one trainer rank per server (or several: --ranks-per-host K), and
every server names its NIC differently (eth0, ens3, enp1s0, ...).  To prove train.py works like that
without real hardware, each emulated "host" is a network namespace with one
veth NIC renamed to a server-like name and addressed in a private test subnet;
the other ends of the veths hang off one Linux bridge, which plays the switch.
Optionally each host's egress is capped with a tbf qdisc (netem is not
available on every kernel; tbf is).

Usable both as a module (tests and benchmarks: ``Cluster``, ``train``,
``cleanup_stale``) and as a CLI (``train``, ``exec``, ``cleanup``).  Standard
library only, plus the repo's one process supervisor (utils/launch.py); shells
out to ``ip`` and ``tc`` (iproute2).  Needs root
(CAP_NET_ADMIN + CAP_SYS_ADMIN).  Every external call has a timeout, and
teardown always runs, so nothing is left behind; leftovers of runs that were
SIGKILLed carry their owner's pid in their names and are removed by the next
run (or ``cluster.py cleanup``).
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from utils.launch import supervise  # noqa: E402

DEFAULT_NICS = ["eth0", "ens3", "enp1s0", "eno1", "eth1", "ens4", "enp2s0", "eno2"]
PREFIX = "mnr"              # every namespace / bridge / veth we create starts with this
SUBNET = "10.213"           # 10.213.X.0/24 per cluster; only ever configured inside our namespaces
IP_TIMEOUT = 15             # seconds for any single ip/tc call
GRACE = 5.0                 # seconds the other ranks get after one rank failed
TBF_LATENCY = "50ms"        # tbf queue length, expressed as time at the capped rate
MAX_RANKS_PER_HOST = 64     # as train.py's --nproc: more ranks on one machine's cores would look like a hang
NEEDS_ROOT = "needs root (CAP_NET_ADMIN) to create network namespaces; run it with sudo"

# <prefix><owner pid, base36>-<cluster counter><kind><rank>; kind: b=bridge, v=veth, h=namespace.
# Base36 keeps interface names within Linux's 15 characters (e.g. "mnr2ievk-99v252").
_NAME_RE = re.compile(rf"^{PREFIX}([0-9a-z]+)-(\d+)([bvh])(\d*)$")
_counter = itertools.count()
_counter_lock = threading.Lock()
_live_tags: set[str] = set()    # clusters of this process that are up right now


class ClusterError(RuntimeError):
    """Setting up or using the emulated cluster failed (also: not root)."""


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def _cmd(argv: list[str], check: bool = True, timeout: float = IP_TIMEOUT) -> str:
    """Run one ip/tc command with a hard timeout; raise ClusterError on failure."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"timed out after {timeout}s: {' '.join(argv)}") from None
    except FileNotFoundError:
        raise ClusterError(f"{argv[0]} not found; install iproute2") from None
    if check and r.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed: {r.stderr.strip()}")
    return r.stdout


def _check_privileges() -> None:
    """Namespaces need CAP_SYS_ADMIN, links/qdiscs CAP_NET_ADMIN (bits 21 and 12)."""
    if sys.platform != "linux":
        raise ClusterError("network namespaces need Linux")
    try:
        caps = int(re.search(r"^CapEff:\s*([0-9a-f]+)", Path("/proc/self/status").read_text(), re.M)[1], 16)
    except (OSError, TypeError):
        caps = ~0 if os.geteuid() == 0 else 0
    if not (caps >> 12) & 1 or not (caps >> 21) & 1:
        raise ClusterError(NEEDS_ROOT)
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"'{tool}' not found; install iproute2")


def parse_rate(rate: str) -> int:
    """tc-style rate ("1gbit", "200mbit", "10mbps") -> bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?)(bit|bps)?\s*", rate.lower())
    if not m:
        raise ClusterError(f"bad rate {rate!r}; use e.g. 1gbit, 200mbit, 50mbit")
    num, mult, unit = float(m[1]), m[2], m[3] or "bit"
    base = 1024 if mult.endswith("i") else 1000
    bits = num * base ** (" kmgt".index(mult[:1] or " ")) * (8 if unit == "bps" else 1)
    if bits < 8000:
        raise ClusterError(f"rate {rate!r} is too low")
    return int(bits)


def tbf_burst(rate_bits: int) -> int:
    """Bucket size in bytes for a tbf at `rate_bits`.

    10 ms of traffic at the rate (rate/HZ for the coarsest tick, HZ=100), so timer
    and scheduling latency of the sender never leave the link idle and the cap is
    reached; and at least one 64 KiB GSO super-packet, so veth's big segments pass
    without tbf splitting them in software.  The initial burst this allows (10 ms,
    or 64 KiB) is negligible for transfers of a few MB: measured 50mbit..5gbit,
    the achieved wire rate is within 1-2 % of the cap.
    """
    return max(rate_bits // 8 // 100, 64 * 1024)


def _pid_dead(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")    # unreaped zombies count as dead


def _netns_pids(ns: str) -> list[int]:
    return [int(p) for p in _cmd(["ip", "netns", "pids", ns], check=False).split()]


def _kill_netns(ns: str, timeout: float = 5.0) -> None:
    """SIGKILL every process inside namespace `ns`, until none is left (or timeout)."""
    deadline = time.monotonic() + timeout
    while (pids := _netns_pids(ns)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _our_objects() -> tuple[list[str], list[str]]:
    """(namespaces, links) whose names carry our prefix."""
    nss = [l.split()[0] for l in _cmd(["ip", "netns", "list"], check=False).splitlines() if l.strip()]
    links = [l.split(":")[1].strip().split("@")[0] for l in _cmd(["ip", "-o", "link"], check=False).splitlines()]
    return [n for n in nss if _NAME_RE.match(n)], [l for l in links if _NAME_RE.match(l)]


def cleanup_stale() -> list[str]:
    """Remove namespaces/bridges/veths left by earlier runs whose owner is dead.

    The owner pid is encoded in every name, so a run that was SIGKILLed (no
    teardown) is recognised; clusters of live processes are left alone.  Returns
    the names removed.  Called by every Cluster.__enter__.
    """
    _check_privileges()

    def stale(name: str) -> bool:
        m = _NAME_RE.match(name)
        pid = int(m[1], 36)
        if pid == os.getpid():
            return f"{PREFIX}{m[1]}-{m[2]}" not in _live_tags
        return _pid_dead(pid)

    nss, links = _our_objects()
    nss, links = [n for n in nss if stale(n)], [l for l in links if stale(l)]
    for ns in nss:
        _kill_netns(ns)
    # veths first (deleting one end deletes the pair), then bridges, then namespaces
    for name in sorted(links, key=lambda l: _NAME_RE.match(l)[3] == "b"):
        _cmd(["ip", "link", "del", name], check=False)
    for ns in nss:
        _cmd(["ip", "netns", "del", ns], check=False)
    return nss + links


class Cluster:
    """`hosts` emulated servers: one namespace + renamed veth NIC each, one bridge.

    Use as a context manager; __exit__ always kills every process in the
    namespaces and deletes everything, also when the body raised.
    """

    def __init__(self, hosts: int, rate: str | None = None, nics: list[str] | None = None,
                 ranks_per_host: int = 1):
        if not 1 <= hosts <= 253:
            raise ClusterError(f"hosts must be 1..253, got {hosts}")
        if not 1 <= ranks_per_host <= MAX_RANKS_PER_HOST:
            raise ClusterError(f"--ranks-per-host must be 1..{MAX_RANKS_PER_HOST}, got {ranks_per_host}")
        nics = list(nics or DEFAULT_NICS)
        for n in nics:
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,15}", n) or n == "lo":
                raise ClusterError(f"bad NIC name {n!r}")
        self.hosts = hosts
        self.ranks_per_host = ranks_per_host      # ranks 0..K-1 on host 0, K..2K-1 on host 1, ...
        self.world_size = hosts * ranks_per_host
        self.rate = rate
        self.rate_bits = parse_rate(rate) if rate else None
        self.nics = [nics[i % len(nics)] for i in range(hosts)]     # short lists cycle
        with _counter_lock:
            seq = next(_counter)
        self.tag = f"{PREFIX}{_b36(os.getpid())}-{seq % 100}"
        self.subnet = f"{SUBNET}.{seq % 256}"
        self.bridge = f"{self.tag}b"
        self.veths = [f"{self.tag}v{r}" for r in range(hosts)]     # bridge-side ends
        self.names = [f"{self.tag}h{r}" for r in range(hosts)]     # namespaces
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()

    # -- addressing (nic, addr: by host; one rank per host: host = rank) ---------
    def nic(self, host: int) -> str:
        return self.nics[host]

    def addr(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    def host_of(self, rank: int) -> int:
        """The host that runs `rank` (ranks are numbered host by host)."""
        return rank // self.ranks_per_host

    def label(self, rank: int) -> str:
        """How output lines name `rank`: "host1 ens3", or "host1 ens3 rank3" with several per host."""
        host = self.host_of(rank)
        return f"host{host} {self.nic(host)}" + (f" rank{rank}" if self.ranks_per_host > 1 else "")

    def train_argv(self, rank: int, port: int, extra: list[str]) -> list[str]:
        """Exactly the command the README tells users to run for `rank` on its server."""
        return [sys.executable, "-u", str(REPO / "train.py"),
                "--init-method", f"tcp://{self.addr(0)}:{port}",
                "--rank", str(rank), "--world-size", str(self.world_size),
                "--gloo_socket_ifname", self.nic(self.host_of(rank)), *extra]

    # -- lifecycle ----------------------------------------------------------
    def __enter__(self) -> "Cluster":
        _check_privileges()
        cleanup_stale()
        _live_tags.add(self.tag)
        try:
            self._create()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _create(self) -> None:
        _cmd(["ip", "link", "add", self.bridge, "type", "bridge"])
        _cmd(["ip", "link", "set", self.bridge, "up"])
        for r, (ns, veth, nic) in enumerate(zip(self.names, self.veths, self.nics)):
            _cmd(["ip", "netns", "add", ns])
            # the peer is created directly inside the namespace, so "eth0" cannot clash with ours
            _cmd(["ip", "link", "add", veth, "type", "veth", "peer", "name", nic, "netns", ns])
            _cmd(["ip", "link", "set", veth, "master", self.bridge])
            _cmd(["ip", "link", "set", veth, "up"])
            _cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
            _cmd(["ip", "-n", ns, "addr", "add", f"{self.addr(r)}/24", "dev", nic])
            _cmd(["ip", "-n", ns, "link", "set", nic, "up"])
            if self.rate_bits:
                _cmd(["tc", "-n", ns, "qdisc", "add", "dev", nic, "root", "tbf",
                      "rate", f"{self.rate_bits}bit", "burst", str(tbf_burst(self.rate_bits)),
                      "latency", TBF_LATENCY])
        for r in range(self.hosts):
            self._wait_carrier(r)

    def _wait_carrier(self, rank: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while "LOWER_UP" not in _cmd(["ip", "-n", self.names[rank], "-o", "link", "show", self.nic(rank)]):
            if time.monotonic() > deadline:
                raise ClusterError(f"{self.nic(rank)} in {self.names[rank]} has no carrier after {timeout}s")
            time.sleep(0.02)

    def teardown(self) -> None:
        """Kill all processes in our namespaces, then delete veths, bridge, namespaces. Idempotent."""
        with self._lock:
            procs, self._procs = self._procs, []
        for p in procs:
            self.kill(p)
        existing, _ = _our_objects()
        for ns in self.names:
            if ns in existing:
                _kill_netns(ns)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for veth in self.veths:
            _cmd(["ip", "link", "del", veth], check=False)
        _cmd(["ip", "link", "del", self.bridge], check=False)
        for ns in self.names:
            if ns in existing:
                _cmd(["ip", "netns", "del", ns], check=False)
        _live_tags.discard(self.tag)

    # -- processes ----------------------------------------------------------
    def popen(self, rank: int, argv: list[str], env: dict | None = None, **popen_kwargs) -> subprocess.Popen:
        """Start argv inside host `rank`, in its own session so it can be killed as a group.

        `env` is laid over os.environ (None: inherit).  The process is tracked and
        killed at teardown.
        """
        if env is not None:
            env = {**os.environ, **{k: str(v) for k, v in env.items()}}
        p = subprocess.Popen(["ip", "netns", "exec", self.names[rank], *argv], env=env,
                             start_new_session=True, **popen_kwargs)
        with self._lock:
            self._procs.append(p)
        return p

    def run_on(self, rank: int, argv: list[str], timeout: float, input=None,
               capture_output: bool = True, check: bool = False, **kw) -> subprocess.CompletedProcess:
        """Like subprocess.run(argv) but inside host `rank`; kills the group on timeout."""
        if capture_output:
            kw.setdefault("stdout", subprocess.PIPE)
            kw.setdefault("stderr", subprocess.PIPE)
        if input is not None:
            kw.setdefault("stdin", subprocess.PIPE)
        p = self.popen(rank, argv, **kw)
        try:
            out, err = p.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(p)
            p.communicate(timeout=5)
            raise
        r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            r.check_returncode()
        return r

    @staticmethod
    def kill(p: subprocess.Popen) -> None:
        """SIGKILL p's whole process group (only while p is unreaped, so the pgid is surely ours)."""
        if p.returncode is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    # -- faults -------------------------------------------------------------
    def link_down(self, rank: int) -> None:
        """Unplug host `rank`: its switch port goes down, so packets vanish both ways (no RST)."""
        _cmd(["ip", "link", "set", self.veths[rank], "down"])

    def link_up(self, rank: int) -> None:
        _cmd(["ip", "link", "set", self.veths[rank], "up"])
        self._wait_carrier(rank)


def _run_all(cluster: Cluster, argvs: list[list[str]], timeout: float, prefix_output: bool = True,
             grace: float = GRACE) -> int:
    """Start argvs[r] (rank r) on its host, stream output, and supervise (utils.launch.supervise); see train()."""
    out_lock = threading.Lock()

    def pump(rank: int, fd: int) -> None:
        prefix = f"[{cluster.label(rank)}] ".encode()
        with open(fd, "rb") as stream:
            for line in iter(stream.readline, b""):
                with out_lock:
                    sys.stdout.buffer.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                    sys.stdout.flush()

    # the emulated hosts share this machine's cores: split them, as train.py's local launcher does
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(argvs))))}
    procs, pumps = [], []
    for r, argv in enumerate(argvs):
        if not prefix_output:
            procs.append(cluster.popen(cluster.host_of(r), argv, env=threads, stdin=subprocess.DEVNULL))
            continue
        # our own pipe, not stdout=PIPE: supervise would read a PIPE to its end, we stream it line by line
        read_end, write_end = os.pipe()
        try:
            procs.append(cluster.popen(cluster.host_of(r), argv, env=threads, stdin=subprocess.DEVNULL,
                                       stdout=write_end, stderr=subprocess.STDOUT))
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
        print(f"cluster.py: host{host} ({cluster.nic(host)}){f' rank{rank}' if cluster.ranks_per_host > 1 else ''}"
              f" exited with {procs[rank].returncode}; killing the others in {grace:g}s", file=sys.stderr, flush=True)

    def watch(procs: list[subprocess.Popen]) -> None:
        nonlocal first_failure
        codes = [p.poll() for p in procs]       # every one, every round (supervise's own poll stops at a live one)
        if first_failure is None:
            first_failure = next((r for r, rc in enumerate(codes) if rc not in (None, 0)), None)
            if first_failure is not None:
                announce(first_failure)

    outcome = supervise(procs, timeout=timeout, grace=grace, poll=0.05, while_running=watch)
    if outcome.timed_out:
        print(f"cluster.py: timeout after {timeout}s; killing all hosts", file=sys.stderr, flush=True)
    elif outcome.killed:                        # a rank failed and the grace period ran out
        if first_failure is None:               # (failed and grace ran out between two watches)
            first_failure = outcome.codes.index(outcome.failed)
            announce(first_failure)
        print("cluster.py: grace period over; killing remaining hosts", file=sys.stderr, flush=True)
    for t in pumps:
        t.join(timeout=5)
    if outcome.timed_out:
        return 124
    rc = outcome.codes[first_failure] if first_failure is not None else outcome.failed
    return rc if rc >= 0 else 128 - rc          # killed by signal N -> 128+N


def train(hosts: int, extra_args: list[str], rate: str | None = None, nics: list[str] | None = None,
          port: int = 29500, timeout: float = 600, prefix_output: bool = True, grace: float = GRACE,
          ranks_per_host: int = 1) -> int:
    """Run train.py on every emulated host, as users would on real servers (K ranks each,
    sharing the host's one NIC, with ranks_per_host=K).

    Output is streamed per line, prefixed "[host1 ens3] " ("[host1 ens3 rank3] " with several
    ranks per host).  If a rank fails the others get `grace` seconds, then are killed.  Returns
    0 only if every rank returned 0; else the first failing rank's code, or 124 on timeout.
    """
    with Cluster(hosts, rate=rate, nics=nics, ranks_per_host=ranks_per_host) as c:
        return _run_all(c, [c.train_argv(r, port, extra_args) for r in range(c.world_size)],
                        timeout, prefix_output, grace)


def exec_all(hosts: int, template: list[str], rate: str | None = None, nics: list[str] | None = None,
             timeout: float = 600, prefix_output: bool = True, grace: float = GRACE, ranks_per_host: int = 1) -> int:
    """Run a command template for every rank at once, on its host (see the CLI's `exec`)."""
    if len(template) == 1:                  # one word: a shell command line, like ssh
        template = ["sh", "-c", template[0]]
    with Cluster(hosts, rate=rate, nics=nics, ranks_per_host=ranks_per_host) as c:
        argvs = []
        for r in range(c.world_size):
            host = c.host_of(r)
            fields = dict(rank=r, world_size=c.world_size, host=host, local_rank=r % ranks_per_host,
                          addr=c.addr(host), addr0=c.addr(0), nic=c.nic(host))
            try:
                argvs.append([word.format_map(fields) for word in template])
            except (KeyError, IndexError, ValueError) as e:
                raise ClusterError(f"bad command template ({e!r}); fields: {', '.join(fields)}; "
                                   "write {{ }} for literal braces") from None
        return _run_all(c, argvs, timeout, prefix_output, grace)


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
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # don't let a second signal interrupt teardown
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    raise _Signalled(signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    ap = _Parser(prog="cluster.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    for name, help_ in (("train", "run train.py on every host: cluster.py train --hosts 3 -- --epochs 1"),
                        ("exec", "run a command on every host (once per rank); template fields {rank} "
                                 "{world_size} {host} {local_rank} {addr} {addr0} {nic}: "
                                 "cluster.py exec --hosts 2 -- hostname -I")):
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--hosts", type=int, required=True)
        p.add_argument("--ranks-per-host", type=ranks_per_host, default=1, metavar="K",
                       help="ranks on each host, sharing its one NIC (default 1); rank r runs on host r // K")
        p.add_argument("--rate", help="egress cap per host, tc syntax, e.g. 1gbit, 200mbit")
        p.add_argument("--nics", help=f"comma separated NIC names (default {','.join(DEFAULT_NICS)})")
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
            for name in cleanup_stale():
                print(f"removed {name}")
            return 0
        nics = args.nics.split(",") if args.nics else None
        if args.cmd == "train":
            return train(args.hosts, rest, args.rate, nics, args.port, args.timeout, grace=args.grace,
                         ranks_per_host=args.ranks_per_host)
        return exec_all(args.hosts, rest, args.rate, nics, args.timeout, grace=args.grace,
                        ranks_per_host=args.ranks_per_host)
    except ClusterError as e:
        print(f"cluster.py: {e}", file=sys.stderr)
        return 2
    except _Signalled as e:
        print(f"cluster.py: got signal {e.args[0]}; torn down", file=sys.stderr)
        return 128 + e.args[0]


if __name__ == "__main__":
    sys.exit(main())
