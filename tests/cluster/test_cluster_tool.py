"""Tests of scripts/cluster.py itself (emulated hosts = network namespaces).

They need root (CAP_NET_ADMIN); in CI (CI=true) they run as root and must not
skip.  No test depends on train.py.  Every test has a hard timeout.
"""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import cluster
import netns
import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
CLUSTER_PY = SCRIPTS / "cluster.py"

PY = sys.executable


pytestmark = pytest.mark.usefixtures("needs_root")  # tests/conftest.py


def leftovers(tag):
    """Our namespaces and links that belong to the cluster `tag`."""
    nss, links = netns._our_objects()
    return [n for n in nss + links if of_cluster(n, tag)]


def of_cluster(name, tag):
    m = netns._NAME_RE.match(name)
    return bool(m) and f"{cluster.PREFIX}{m[1]}-{m[2]}" == tag


def readline(proc, timeout=10):
    """One line of proc.stdout, or fail (never block forever)."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            pytest.fail(f"no output from {proc.args} within {timeout}s")
    return proc.stdout.readline().strip()


def pid_dead(pid):
    return netns._pid_dead(pid)


# Small socket programs run inside the namespaces.
ECHO_SERVER = r"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5001)); s.listen(1); print("READY", flush=True)
c, peer = s.accept(); c.sendall(c.recv(100) + b" from " + peer[0].encode()); c.close()
"""
CONNECT = r"""
import socket, sys, time
deadline = time.monotonic() + 10
while True:
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5); break
    except OSError:
        if time.monotonic() > deadline: raise
        time.sleep(0.02)
"""
ECHO_CLIENT = (
    CONNECT
    + r"""
s.sendall(b"hello"); print(s.recv(100).decode(), flush=True)
"""
)
SINK_SERVER = r"""
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5001)); s.listen(1); print("READY", flush=True)
c, _ = s.accept(); n = 0; t0 = first = None
while b := c.recv(1 << 20):
    if t0 is None: t0, first = time.monotonic(), len(b)
    n += len(b)
print(n, first, time.monotonic() - t0, flush=True)
"""
SOURCE_CLIENT = (
    CONNECT
    + r"""
left = int(sys.argv[3]); buf = b"x" * (1 << 20)
while left: left -= s.send(buf[:min(left, len(buf))])
s.close()
"""
)
PINGPONG_SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5001)); s.listen(1); print("READY", flush=True)
c, _ = s.accept(); assert c.recv(4) == b"ping"; c.sendall(b"pong")
for line in sys.stdin: c.sendall(line.encode())      # the test makes us talk
"""
PATIENT_CLIENT = (
    CONNECT
    + r"""
s.sendall(b"ping"); assert s.recv(4) == b"pong"; print("CONNECTED", flush=True)
sys.stdin.readline()                                  # link is down now
s.sendall(b"x" * 1000)                                # into the void; must not fail
s.settimeout(2.0)
try:
    d = s.recv(100); print("DATA" if d else "EOF", flush=True)
except socket.timeout:
    print("SILENCE", flush=True)
except OSError as e:
    print("ERROR", e, flush=True)
sys.stdin.readline()                                  # link is up again
s.settimeout(15)
print("RECOVERED", s.recv(100).decode().strip(), flush=True)
"""
)
CONNECT_ONCE = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0); print("CONNECTED")
except socket.timeout: print("TIMEOUT")
except ConnectionRefusedError: print("REFUSED")
except OSError as e: print("ERROR", e.errno)
"""


@pytest.mark.timeout(30)
def test_hosts_have_named_nics_addresses_and_reach_each_other():
    with cluster.Cluster(3) as c:
        assert [c.nic(r) for r in range(3)] == cluster.DEFAULT_NICS[:3]
        assert len(set(c.names)) == 3
        for r in range(3):
            links = c.run_on(r, ["ip", "-o", "link"], timeout=10, text=True, check=True).stdout
            assert re.findall(r"^\d+: ([^:@]+)", links, re.M) == ["lo", c.nic(r)]
            assert "LOWER_UP" in links
            addrs = c.run_on(r, ["ip", "-o", "-4", "addr"], timeout=10, text=True, check=True).stdout
            assert f"{c.nic(r)}    inet {c.addr(r)}/24" in addrs
        assert len({c.addr(r) for r in range(3)}) == 3
        assert c.train_argv(1, 29501, ["--epochs", "1"]) == [
            sys.executable,
            "-u",
            str(SCRIPTS.parent / "train.py"),
            "--init-method",
            f"tcp://{c.addr(0)}:29501",
            "--rank",
            "1",
            "--world-size",
            "3",
            "--gloo_socket_ifname",
            "ens3",
            "--epochs",
            "1",
        ]
        # the test subnet exists only inside our namespaces
        root = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=10).stdout
        assert f"{c.addr(0)}/" not in root

        server = c.popen(2, [PY, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True)
        assert readline(server) == "READY"
        out = c.run_on(0, [PY, "-c", ECHO_CLIENT, c.addr(2), "5001"], timeout=15, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"hello from {c.addr(0)}"
        assert server.wait(timeout=10) == 0
    assert leftovers(c.tag) == []


@pytest.mark.timeout(30)
def test_tbf_caps_egress_rate():
    size, rate = 5_000_000, "50mbit"
    with cluster.Cluster(2, rate=rate) as c:
        qdisc = subprocess.run(
            ["tc", "-n", c.names[0], "qdisc", "show", "dev", c.nic(0)], capture_output=True, text=True, timeout=10
        ).stdout
        assert "tbf" in qdisc and "rate 50Mbit" in qdisc
        server = c.popen(1, [PY, "-c", SINK_SERVER], stdout=subprocess.PIPE, text=True)
        assert readline(server) == "READY"
        c.run_on(0, [PY, "-c", SOURCE_CLIENT, c.addr(1), "5001", str(size)], timeout=20, check=True)
        n, first, elapsed = readline(server, 20).split()
    n, first, elapsed = int(n), int(first), float(elapsed)
    assert n == size
    expected = size * 8 / 50e6  # 0.8 s of payload at the cap
    assert 0.85 * expected <= elapsed <= 1.15 * expected, f"{elapsed:.3f}s vs {expected:.3f}s"
    # tbf counts whole frames: 1448 B payload travel as 1514 B (TCP/IP/Ethernet headers)
    wire_rate = (n - first) * 8 / elapsed * 1514 / 1448
    print(f"5 MB at {rate}: {elapsed:.3f}s; wire rate {wire_rate / 1e6:.1f} Mbit/s")
    assert abs(wire_rate / 50e6 - 1) < 0.10, f"achieved {wire_rate / 1e6:.1f} Mbit/s"


@pytest.mark.timeout(40)
def test_link_down_is_silence_and_link_up_restores():
    with cluster.Cluster(3) as c:
        closed_port = [PY, "-c", CONNECT_ONCE, c.addr(1), "5999"]
        # link up: a closed port answers with RST at once
        assert c.run_on(2, closed_port, timeout=10, text=True).stdout.strip() == "REFUSED"

        server = c.popen(1, [PY, "-c", PINGPONG_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert readline(server) == "READY"
        client = c.popen(
            0, [PY, "-c", PATIENT_CLIENT, c.addr(1), "5001"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert readline(client) == "CONNECTED"

        c.link_down(1)
        server.stdin.write("during\n")
        server.stdin.flush()  # sent while unplugged: lost
        client.stdin.write("\n")
        client.stdin.flush()
        assert readline(client, 10) == "SILENCE"  # blocked recv just times out
        # no RST any more, not even from a closed port: the connect attempt just times out
        assert c.run_on(2, closed_port, timeout=10, text=True).stdout.strip() == "TIMEOUT"

        c.link_up(1)
        client.stdin.write("\n")
        client.stdin.flush()
        # the established connection survives: TCP retransmits what was lost
        assert readline(client, 20) == "RECOVERED during"
        assert client.wait(timeout=10) == 0
        assert c.run_on(2, closed_port, timeout=10, text=True).stdout.strip() == "REFUSED"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("body_raises", [False, True])
def test_teardown_leaves_nothing(body_raises):
    class Boom(Exception):
        pass

    try:
        with cluster.Cluster(2, rate="100mbit", nics=["ens3", "eno1"]) as c:
            assert len(leftovers(c.tag)) == 2 + 2 + 1  # namespaces, veths, bridge
            proc = c.popen(1, ["sleep", "300"])
            if body_raises:
                raise Boom()
    except Boom:
        assert body_raises
    assert leftovers(c.tag) == []
    ns_list = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert not any(n in ns_list for n in c.names)
    assert proc.returncode == -signal.SIGKILL
    c.teardown()  # idempotent
    assert leftovers(c.tag) == []


@pytest.mark.timeout(30)
def test_failed_setup_leaves_nothing(monkeypatch):
    monkeypatch.setattr(netns, "TBF_LATENCY", "not-a-time")  # the tc call of host 0 fails
    c = cluster.Cluster(2, rate="1gbit")
    with pytest.raises(cluster.ClusterError, match="tc -n"):
        with c:
            pass
    assert leftovers(c.tag) == []


@pytest.mark.timeout(30)
def test_processes_still_running_at_exit_are_killed():
    with cluster.Cluster(1) as c:
        # one child escapes the process group (setsid); the namespace sweep must still get it
        proc = c.popen(0, ["sh", "-c", "setsid sleep 300 & exec sleep 300"])
        deadline = time.monotonic() + 10
        while len(pids := netns._netns_pids(c.names[0])) < 2:
            assert time.monotonic() < deadline, pids
            time.sleep(0.05)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while not all(pid_dead(p) for p in pids):
        assert time.monotonic() < deadline, f"still alive: {pids}"
        time.sleep(0.05)


def drop_net_caps():
    """In the child before exec: drop CAP_NET_ADMIN (12) and CAP_SYS_ADMIN (21), like a normal user."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (12, 21):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def cli(*args, timeout=60, **kw):
    t = time.monotonic()
    r = subprocess.run([PY, str(CLUSTER_PY), *args], capture_output=True, text=True, timeout=timeout, **kw)
    return r, time.monotonic() - t


@pytest.mark.timeout(60)
def test_exec_cli_failure_kills_the_others():
    code = (
        "import os, sys, time; print('pid', os.getpid(), flush=True); time.sleep(0.5); "
        "sys.exit(3) if {rank}==1 else time.sleep(60)"
    )
    r, elapsed = cli("exec", "--hosts", "3", "--timeout", "40", "--", PY, "-c", code)
    assert r.returncode == 3, r.stderr
    assert elapsed < cluster.GRACE + 10
    assert "host1 (ens3) exited with 3" in r.stderr
    pids = {int(m[1]): int(m[2]) for m in re.finditer(r"^\[host(\d) \w+\] pid (\d+)$", r.stdout, re.M)}
    assert sorted(pids) == [0, 1, 2], r.stdout
    assert all(pid_dead(p) for p in pids.values())


@pytest.mark.timeout(30)
def test_exec_cli_success_template_and_prefixes():
    r, _ = cli(
        "exec",
        "--hosts",
        "2",
        "--nics",
        "enp1s0,eno2",
        "--timeout",
        "20",
        "--",
        "echo {rank} {world_size} {addr} {addr0} {nic}; cat /sys/class/net/{nic}/operstate",
    )
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    assert lines[0].startswith("[host0 enp1s0] 0 2 10.213.") and lines[0].endswith(".1 enp1s0")
    assert "[host0 enp1s0] up" in lines and "[host1 eno2] up" in lines
    assert re.search(r"^\[host1 eno2\] 1 2 10\.213\.\d+\.2 10\.213\.\d+\.1 eno2$", r.stdout, re.M)


@pytest.mark.timeout(30)
def test_ranks_per_host_share_their_host_and_bad_counts_are_one_line():
    r, _ = cli(
        "exec",
        "--hosts",
        "2",
        "--ranks-per-host",
        "2",
        "--timeout",
        "20",
        "--",
        "echo {rank}/{world_size} host {host} local {local_rank} {nic} {addr}",
    )
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    assert [re.sub(r"10\.213\.\d+\.", "A.", line) for line in lines] == [
        "[host0 eth0 rank0] 0/4 host 0 local 0 eth0 A.1",
        "[host0 eth0 rank1] 1/4 host 0 local 1 eth0 A.1",
        "[host1 ens3 rank2] 2/4 host 1 local 0 ens3 A.2",
        "[host1 ens3 rank3] 3/4 host 1 local 1 ens3 A.2",
    ], r.stdout
    for bad, why in (
        ("0", "must be 1..64"),
        ("-1", "must be 1..64"),
        ("two", "expected a whole number"),
        ("65", "must be 1..64"),
    ):
        r, _ = cli("train", "--hosts", "2", "--ranks-per-host", bad, "--", "--epochs", "1")
        assert r.returncode == 2 and r.stdout == "", (bad, r.stdout, r.stderr)
        assert r.stderr.strip().splitlines() == [
            f"cluster.py: error: argument --ranks-per-host: {why}, got '{bad}' (see --help)"
        ], r.stderr


@pytest.mark.timeout(30)
def test_cli_timeout_usage_error_and_no_root():
    r, elapsed = cli("exec", "--hosts", "2", "--timeout", "1", "--", "sleep", "30")
    assert r.returncode == 124 and elapsed < 10
    assert "timeout" in r.stderr

    r, _ = cli("exec", "--rate", "1gbit", "--", "true")  # --hosts missing
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr

    r, _ = cli("exec", "--hosts", "2", "--rate", "fast", "--", "true")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr

    r, _ = cli("exec", "--hosts", "2", "--", "true", preexec_fn=drop_net_caps)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"cluster.py: {cluster.NEEDS_ROOT}"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cli_tears_down_on_signal(sig):
    proc = subprocess.Popen(
        [PY, str(CLUSTER_PY), "exec", "--hosts", "2", "--timeout", "60", "--", "echo started; exec sleep 60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert readline(proc, 20).endswith("started")
        ours = [n for n in sum(netns._our_objects(), []) if n.startswith(f"mnr{netns._b36(proc.pid)}-")]
        assert len(ours) == 5
        proc.send_signal(sig)
        assert proc.wait(timeout=15) == 128 + sig
    finally:
        proc.kill()
        proc.communicate(timeout=10)
    assert not [n for n in sum(netns._our_objects(), []) if n in ours]


OWNER = r"""
import sys, time
import cluster
c = cluster.Cluster(2).__enter__()
p = c.popen(0, ["sleep", "300"])
print(c.tag, p.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.timeout(30)
def test_cleanup_stale_removes_leftovers_of_killed_run():
    owner = subprocess.Popen([PY, "-c", OWNER, str(SCRIPTS)], stdout=subprocess.PIPE, text=True)
    try:
        tag, sleeper = readline(owner, 20).split()
        sleeper = int(sleeper)
        assert len(leftovers(tag)) == 5
        cluster.cleanup_stale()  # owner alive: its cluster is left alone
        assert len(leftovers(tag)) == 5
    finally:
        owner.kill()
        owner.wait(timeout=10)
    assert len(leftovers(tag)) == 5 and not pid_dead(sleeper)  # SIGKILL: no teardown ran
    removed = cluster.cleanup_stale()
    assert sorted(n for n in removed if of_cluster(n, tag)) == sorted(
        [f"{tag}h0", f"{tag}h1", f"{tag}v0", f"{tag}v1", f"{tag}b"]
    )
    assert leftovers(tag) == []
    deadline = time.monotonic() + 5
    while not pid_dead(sleeper):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r, _ = cli("cleanup", timeout=20)
    assert r.returncode == 0, r.stderr
