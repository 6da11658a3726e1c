#!/usr/bin/env python3
"""Emulated servers on one Linux machine: network namespaces, veth NICs named like a server's, a bridge.

Users run one trainer rank per server (or several: --ranks-per-host K), and every server names
its NIC differently (eth0, ens3, enp1s0, ...). To prove train.py works like that without real
hardware, each emulated "host" is a network namespace with one veth NIC renamed to a
server-like name and addressed in a private test subnet; the other ends of the veths hang off
one Linux bridge, which plays the switch. Optionally each host's egress is capped with a tbf
qdisc (netem is not available on every kernel; tbf is). With ``gateway=True`` the bridge gets an
address in the hosts' subnet too, so this machine's own (root) namespace reaches every host, as a
user's laptop reaches its servers.

``Cluster`` is the context manager that builds and tears down one such cluster; scripts/cluster.py
is its command line (train, exec, cleanup). Standard library only; shells out to ``ip`` and ``tc``
(iproute2). Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN). Every external call has a timeout, and
teardown always runs, so nothing is left behind; leftovers of runs that were SIGKILLed carry
their owner's pid in their names and are removed by the next run (``cleanup_stale``).
"""

from __future__ import annotations

import fcntl
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

DEFAULT_NICS = ["eth0", "ens3", "enp1s0", "eno1", "eth1", "ens4", "enp2s0", "eno2"]
PREFIX = "mnr"  # every namespace / bridge / veth we create starts with this
SUBNET = "10.213"  # 10.213.X.0/24 per cluster; inside our namespaces, and on the bridge of a gateway cluster
GATEWAY_HOST = 254  # the bridge's address in a gateway cluster's subnet (hosts are .1 .. .253)
IP_TIMEOUT = 15  # seconds for any single ip/tc call
GRACE = 5.0  # seconds the other ranks get after one rank failed
TBF_LATENCY = "50ms"  # tbf queue length, expressed as time at the capped rate
MAX_RANKS_PER_HOST = 64  # as train.py's --nproc: more ranks on one machine's cores would look like a hang
NEEDS_ROOT = "needs root (CAP_NET_ADMIN) to create network namespaces; run it with sudo"

# <prefix><owner pid, base36>-<cluster counter><kind><rank>; kind: b=bridge, v=veth, h=namespace.
# Base36 keeps interface names within Linux's 15 characters (e.g. "mnr2ievk-99v252").
_NAME_RE = re.compile(rf"^{PREFIX}([0-9a-z]+)-(\d+)([bvh])(\d*)$")
_counter = itertools.count()
_counter_lock = threading.Lock()
_live_tags: set[str] = set()  # clusters of this process that are up right now


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
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")  # unreaped zombies count as dead


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
    nss = [line.split()[0] for line in _cmd(["ip", "netns", "list"], check=False).splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in _cmd(["ip", "-o", "link"], check=False).splitlines()]
    return [n for n in nss if _NAME_RE.match(n)], [link for link in links if _NAME_RE.match(link)]


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
    nss, links = [n for n in nss if stale(n)], [link for link in links if stale(link)]
    for ns in nss:
        _kill_netns(ns)
    # veths first (deleting one end deletes the pair), then bridges, then namespaces
    for name in sorted(links, key=lambda link: _NAME_RE.match(link)[3] == "b"):
        _cmd(["ip", "link", "del", name], check=False)
    for ns in nss:
        _cmd(["ip", "netns", "del", ns], check=False)
    return nss + links


class Cluster:
    """`hosts` emulated servers: one namespace + renamed veth NIC each, one bridge.

    Use as a context manager; __exit__ always kills every process in the
    namespaces and deletes everything, also when the body raised.
    """

    def __init__(
        self,
        hosts: int,
        rate: str | None = None,
        nics: list[str] | None = None,
        ranks_per_host: int = 1,
        starter=None,
        gateway: bool = False,
    ):
        if not 1 <= hosts <= 253:
            raise ClusterError(f"hosts must be 1..253, got {hosts}")
        if not 1 <= ranks_per_host <= MAX_RANKS_PER_HOST:
            raise ClusterError(f"--ranks-per-host must be 1..{MAX_RANKS_PER_HOST}, got {ranks_per_host}")
        nics = list(nics or DEFAULT_NICS)
        for n in nics:
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,15}", n) or n == "lo":
                raise ClusterError(f"bad NIC name {n!r}")
        self.hosts = hosts
        # how processes start in a host: starter(argv, netns=NAME, **popen_kwargs), Popen-like (the
        # tests fork theirs from a process that has loaded torch); None: `ip netns exec NAME argv`
        self.starter = starter
        self.ranks_per_host = ranks_per_host  # ranks 0..K-1 on host 0, K..2K-1 on host 1, ...
        self.world_size = hosts * ranks_per_host
        self.rate = rate
        self.rate_bits = parse_rate(rate) if rate else None
        self.nics = [nics[i % len(nics)] for i in range(hosts)]  # short lists cycle
        with _counter_lock:
            seq = next(_counter)
        self.tag = f"{PREFIX}{_b36(os.getpid())}-{seq % 100}"
        self.subnet = f"{SUBNET}.{seq % 256}"  # a gateway cluster moves to a free one as it is made
        self.gateway = gateway
        self.bridge = f"{self.tag}b"
        self.veths = [f"{self.tag}v{r}" for r in range(hosts)]  # bridge-side ends
        self.names = [f"{self.tag}h{r}" for r in range(hosts)]  # namespaces
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()

    # -- addressing (nic, addr: by host; one rank per host: host = rank) ---------
    def nic(self, host: int) -> str:
        return self.nics[host]

    def addr(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    @property
    def gateway_addr(self) -> str | None:
        """The bridge's address, which this machine's root namespace reaches the hosts from (gateway=True)."""
        return f"{self.subnet}.{GATEWAY_HOST}" if self.gateway else None

    def host_of(self, rank: int) -> int:
        """The host that runs `rank` (ranks are numbered host by host)."""
        return rank // self.ranks_per_host

    def label(self, rank: int) -> str:
        """How output lines name `rank`: "host1 ens3", or "host1 ens3 rank3" with several per host."""
        host = self.host_of(rank)
        return f"host{host} {self.nic(host)}" + (f" rank{rank}" if self.ranks_per_host > 1 else "")

    def train_argv(self, rank: int, port: int, extra: list[str], card: bool = True) -> list[str]:
        """Exactly the command the README tells users to run for `rank` on its server (card: with
        --gloo_socket_ifname naming its host's NIC; False: the rank finds it)."""
        return [
            sys.executable,
            "-u",
            str(REPO / "train.py"),
            "--init-method",
            f"tcp://{self.addr(0)}:{port}",
            "--rank",
            str(rank),
            "--world-size",
            str(self.world_size),
            *(["--gloo_socket_ifname", self.nic(self.host_of(rank))] if card else []),
            *extra,
        ]

    # -- lifecycle ----------------------------------------------------------
    def __enter__(self) -> Cluster:
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
        if self.gateway:
            self._address_bridge()
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
                _cmd(
                    [
                        "tc",
                        "-n",
                        ns,
                        "qdisc",
                        "add",
                        "dev",
                        nic,
                        "root",
                        "tbf",
                        "rate",
                        f"{self.rate_bits}bit",
                        "burst",
                        str(tbf_burst(self.rate_bits)),
                        "latency",
                        TBF_LATENCY,
                    ]
                )
        for r in range(self.hosts):
            self._wait_carrier(r)

    def _address_bridge(self) -> None:
        """Give the bridge GATEWAY_HOST in a subnet that no other interface of the root namespace has.

        Clusters without a gateway keep their subnets inside their namespaces, so two may share one;
        in the root namespace two bridges with one subnet would make routing a coin toss. Another
        process may be choosing at the same moment: the choice and the address are made under a lock.
        """
        with open(os.path.join(tempfile.gettempdir(), f"{PREFIX}-gateway.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            routes = _cmd(["ip", "-o", "-4", "route", "show", "table", "all"], check=False)
            taken = {int(m) for m in re.findall(rf"(?<![\d.]){re.escape(SUBNET)}\.(\d+)\.", routes)}
            first = int(self.subnet.rsplit(".", 1)[1])
            free = [x % 256 for x in range(first, first + 256) if x % 256 not in taken]
            if not free:
                raise ClusterError(f"no free {SUBNET}.X.0/24 subnet left in the root namespace")
            self.subnet = f"{SUBNET}.{free[0]}"
            _cmd(["ip", "addr", "add", f"{self.gateway_addr}/24", "dev", self.bridge])

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
        if self.starter is not None:
            p = self.starter(argv, netns=self.names[rank], env=env, start_new_session=True, **popen_kwargs)
        else:
            p = subprocess.Popen(
                ["ip", "netns", "exec", self.names[rank], *argv], env=env, start_new_session=True, **popen_kwargs
            )
        with self._lock:
            self._procs.append(p)
        return p

    def run_on(
        self,
        rank: int,
        argv: list[str],
        timeout: float,
        input=None,
        capture_output: bool = True,
        check: bool = False,
        **kw,
    ) -> subprocess.CompletedProcess:
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
