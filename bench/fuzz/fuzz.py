"""Bad traffic at a running job's ports: the job must not notice.

    python bench/fuzz/fuzz.py                               100,000 datagrams and TCP junk, 3 ranks
    python bench/fuzz/fuzz.py --datagrams 3000 --nmap       fewer, and nmap's UDP and TCP version scans

The job is `python train.py` with the original per-server command (--rank, --world-size,
--init-method) on loopback, run twice: undisturbed, then under fire. Under fire, once training
has begun, every member's control port (the job's port + its rank) gets, in turn:

    random bytes            any size from 0 to 2,000 bytes
    mutated messages        every kind, each field missing, of a wrong type, out of range or huge,
                            signed with the job's own key (what a buggy peer could send)
    forged messages         every kind, well formed, signed with another key
    replays                 genuine datagrams of the job, captured on lo (root only)
    the old exploits        b"[1]" and b'{"t":"join"}', unsigned

and every TCP port the ranks listen on (gloo's, the rendezvous store) gets random bytes. Passes
when every rank exits 0 and the final sha256 equals the undisturbed run's; prints what each rank
dropped.
"""

import argparse
import dataclasses
import hashlib
import hmac
import json
import os
import random
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # bench/common: harness, stats (run directly)
import harness  # noqa: F401  (first: puts the repository's utils/ on the path)

from utils.elastic.wire import (
    KINDS,
    Alive,
    Ask,
    Decision,
    Envelope,
    FencedOut,
    Join,
    Refused,
    Rejected,
    Status,
    Stop,
    Stopping,
)
from utils.setup.launch import free_port, supervise

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENTRY = {"address": ["127.0.0.1", 23457], "pid": 4242, "host": "node2"}
PROGRESS = {
    "epoch": 1,
    "epochs": 2,
    "step": 12,
    "steps": 938,
    "images_per_second": 450.5,
    "share": 0.5,
    "loss": 0.25,
    "seconds_left": 61.5,
    "host": "node2",
    "pid": 4242,
    "restarts": 0,
    "rejoins": 1,
}
SAMPLES = [
    Alive(3, "recovering", [1, 12], 1, 2),
    Alive(3, "training", progress=PROGRESS),
    Decision(4, "4.0.0badcafe", [0, 2], ["127.0.0.1", 40000], 2, [1, 13], {"0": [1, 12], "2": [1, 13]}, 0),
    Decision(2, "2.0.deadbeef", [0, 1, 5], ["127.0.0.1", 40001], 0, [2, 0], book={"5": ENTRY}, joined={"ab" * 6: 5}),
    FencedOut(7),
    Join("ab" * 6, 1, {"lr": 0.004, "allreduce": "ring"}, ENTRY, {"torch": "2.14.1", "program": "0" * 16}),
    Refused("ab" * 6, "the job has --lr 0.004, this server has 0.01"),
    Ask("ab" * 6),
    Status("ab" * 6, 2, "training", [{"id": 0, "heard": None, "host": "node1", "pid": 41, "progress": PROGRESS}]),
    Stop("ab" * 6),
    Stopping("ab" * 6),
]
BAD_VALUES = (True, "x", -1, 2**40, 1.5, [], {}, [-1, -1], "y" * 70_000, [0] * 5000)


def mutations(message):
    """(field, value or MISSING, fields): each field missing, of a wrong type, out of range, or huge."""
    good = dataclasses.asdict(message)
    for name in good:
        yield name, dataclasses.MISSING, {k: v for k, v in good.items() if k != name}
        for bad in BAD_VALUES:
            yield name, bad, dict(good, **{name: bad})


def kind_of(message):
    return {cls: name for name, cls in KINDS.items()}[type(message)]


def signed(secret, fields):
    """A datagram of arbitrary fields under a true signature: what a peer holding the key could send."""
    body = json.dumps(fields).encode()
    return hmac.new(secret, body, hashlib.sha256).digest() + body


def malformed(secret, sender):
    """Every mutation of every sample that the job's own check refuses, signed with its key."""
    check, out = Envelope(secret, -1), []
    for message in SAMPLES:
        for _, _, fields in mutations(message):
            datagram = signed(
                secret, {"kind": kind_of(message), "job": "", "from": sender, "n": time.time_ns(), **fields}
            )
            try:
                check.open(datagram)  # (a mutation that is still a valid message is not bad traffic: left out)
            except Rejected:
                out.append(datagram)
    return out


def volley(secret, captured, count, seed=1):
    """`count` bad datagrams, (category, bytes), the categories in turn."""
    rng = random.Random(seed)
    forger = Envelope(os.urandom(32), 0)
    bad = malformed(secret, 0)
    makers = {
        "random bytes": lambda: rng.randbytes(rng.randint(0, 2000)),
        "mutated, signed with the job's key": lambda: rng.choice(bad),
        "forged with another key": lambda: forger.seal(rng.choice(SAMPLES)),
        "old exploits": lambda: rng.choice([b"[1]", b'{"t":"join"}']),
    }
    if captured:
        makers["replays of genuine datagrams"] = lambda: rng.choice(captured)
    names = list(makers)
    return [(names[i % len(names)], makers[names[i % len(names)]]()) for i in range(count)]


def capture(ports, seconds):
    """Genuine datagrams to `ports` on lo for `seconds` (an AF_PACKET socket: root only; else none)."""
    try:
        sniffer = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
        sniffer.bind(("lo", 0))
    except (PermissionError, OSError):
        return []
    sniffer.settimeout(0.1)
    found, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            frame = sniffer.recv(65535)
        except TimeoutError:
            continue
        ip = frame[14:]
        if len(ip) < 28 or ip[9] != 17:  # UDP only
            continue
        header = (ip[0] & 15) * 4
        port = struct.unpack("!H", ip[header + 2 : header + 4])[0]
        if port in ports:
            found.append(bytes(ip[header + 8 :]))
    sniffer.close()
    return found


def udp_buffer_errors():
    """The kernel's count of UDP datagrams dropped for a full receive buffer (this network namespace)."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Udp:")]
    return int(rows[1][rows[0].index("RcvbufErrors")])


def listening_tcp_ports(pids):
    """The TCP ports the processes `pids` listen on (from /proc: their sockets' inodes)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def tcp_junk(ports, rng):
    for port in ports:
        for size in (1, 64, 4096, 65536):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    s.sendall(rng.randbytes(size))
            except OSError:
                pass


def start(folder, port, ranks, args, env=None, popen=subprocess.Popen):
    """The job's ranks, each with the original per-server command (--rank, --world-size, --init-method);
    env: more variables for them; popen: how a process starts (the tests fork theirs)."""
    env, pipe = dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), subprocess.PIPE
    common = ["--world-size", str(ranks), "--init-method", f"tcp://127.0.0.1:{port}", "--data-dir", f"{REPO}/data"]
    argv = [sys.executable, os.path.join(REPO, "train.py")]
    kw = dict(cwd=folder, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True)
    return [popen([*argv, "--rank", str(r), *common, *args], **kw) for r in range(ranks)]


def run_job(ranks, args, timeout, attack=None, env=None, popen=subprocess.Popen):
    """One run; attack(procs, folder, port) runs beside it; env and popen: as start's. Returns
    (codes, outputs, attack's result)."""
    folder, port = tempfile.mkdtemp(prefix="fuzz-"), free_port()
    try:
        procs, result = start(folder, port, ranks, args, env, popen), {}
        thread = None
        if attack is not None:
            thread = threading.Thread(target=lambda: result.update(attack(procs, folder, port)), daemon=True)
            thread.start()
        outcome = supervise(procs, timeout=timeout, poll=0.1)
        if thread is not None:
            thread.join(timeout=60)
        return [p.returncode for p in procs], outcome.outputs, result
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def fire(count, ranks, nmap, rate):
    """The attack: waits for training, then the datagrams, the TCP junk and (optionally) nmap."""

    def attack(procs, folder, port):
        key_file, deadline = os.path.join(folder, "runs", "checkpoint.pt.key"), time.monotonic() + 120
        while not os.path.exists(key_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(key_file, "rb") as f:
            secret = f.read().strip()
        ports = [port + r for r in range(ranks)]
        captured = capture(set(ports), 1.5)
        shots, sent, overflowed = volley(secret, captured, count), {}, udp_buffer_errors()
        sock, rng, started = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), random.Random(2), time.monotonic()
        for i, (category, datagram) in enumerate(shots):
            try:
                sock.sendto(datagram[:65_000], ("127.0.0.1", ports[i % ranks]))
                sent[category] = sent.get(category, 0) + 1
            except OSError:
                pass
            if i % 100 == 99:  # paced: bad traffic, not a flood that fills the sockets' buffers
                time.sleep(max(0.0, started + (i + 1) / rate - time.monotonic()))
        time.sleep(0.5)
        overflowed = udp_buffer_errors() - overflowed
        tcp = listening_tcp_ports([p.pid for p in procs])
        tcp_junk(tcp, rng)
        scanned = []
        if nmap:
            for kind in ("-sU", "-sT"):
                targets = ports if kind == "-sU" else tcp
                cmd = ["nmap", kind, "-sV", "-p", ",".join(map(str, targets)), "127.0.0.1"]
                subprocess.run(cmd, capture_output=True, timeout=600)
                scanned.append(" ".join(cmd))
        running = all(p.poll() is None for p in procs)  # the attack ended before the job did
        result = dict(sent=sent, captured=len(captured), tcp_ports=tcp, nmap=scanned, overflowed=overflowed)
        return result | {"running": running}

    return attack


def final_sha(out):
    found = re.findall(r"sha256 ([0-9a-f]{64})", out)
    return found[-1] if found else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datagrams", type=int, default=100_000, help="bad datagrams in all (default %(default)s)")
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--rate", type=float, default=4000.0, help="datagrams a second (default %(default)s)")
    p.add_argument("--train-subset", type=int, default=19200, help="images (default %(default)s)")
    p.add_argument("--nmap", action="store_true", help="also scan every port with nmap -sU -sV and -sT -sV")
    p.add_argument("--timeout", type=float, default=900.0)
    a = p.parse_args(argv)
    args = ["--epochs", "1", "--train-subset", str(a.train_subset), "--test-subset", "500", "--timeout", "60"]
    codes, outputs, _ = run_job(a.ranks, args, a.timeout)
    reference = final_sha(outputs[0][0])
    print(f"undisturbed: exit codes {codes}, sha256 {reference}", flush=True)
    codes_fired, outputs, result = run_job(a.ranks, args, a.timeout, fire(a.datagrams, a.ranks, a.nmap, a.rate))
    sha = final_sha(outputs[0][0])
    print(f"under fire:  exit codes {codes_fired}, sha256 {sha}")
    for category, n in result.get("sent", {}).items():
        print(f"  sent {n:>7,}  {category}")
    tcp = f"TCP junk into {result.get('tcp_ports')}"
    print(f"  captured {result.get('captured', 0)} genuine datagrams to replay; {tcp}")
    print(f"  the kernel dropped {result.get('overflowed', 0):,} (receive buffers full): never reached a rank")
    for scan in result.get("nmap", []):
        print(f"  scanned: {scan}")
    print(f"  every rank still training when the attack ended: {result.get('running')}")
    for out, _ in outputs:
        for line in out.splitlines():
            if "control datagrams" in line:
                print("  " + line)
    ok = codes == codes_fired == [0] * a.ranks and sha == reference is not None
    print("PASS: the job did not notice" if ok else "FAIL")
    if not ok:
        for r, (_, err) in enumerate(outputs):
            print(f"--- rank {r} stderr:\n{err[-2000:]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
