"""What the two benchmarks share: starting one world of rank processes, and never leaving one behind."""
from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
sys.path[:0] = [str(REPO), str(REPO / "scripts")]          # utils/ (ranks), scripts/cluster.py (driver)
import cluster  # noqa: E402

GRACE = 5.0   # seconds the other ranks get to notice a failed one before they are killed


class LaunchError(RuntimeError):
    """A world of ranks failed or timed out; the message holds each rank's last stderr lines."""


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr and exit code 2, as train.py does (no usage dump)."""

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def number_list(kind):
    """argparse type: "2,3,4" -> [2, 3, 4], with a clear error for anything else."""
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {'whole ' if kind is int else ''}numbers, "
                                             f"got {text!r}") from None
    return parse


def parse_rate(rate: str) -> int:
    """tc-style rate ('200mbit', '1gbit', '10mbps' = megaBYTES/s) -> bits per second (for argparse)."""
    try:
        return cluster.parse_rate(rate)
    except cluster.ClusterError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_group(p: subprocess.Popen) -> None:
    """SIGKILL the child's process group (children run in their own sessions); only while unreaped."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            p.kill()


def fmt(x, spec="{:.2f}", none="-"):
    return none if x is None else spec.format(x)


def sign_test_p(faster: int, total: int) -> float:
    """Two-sided sign test: how likely a split at least this uneven is if neither side is faster.

    Paired repetitions ran side by side, so each is a coin toss under "no difference"; p < 0.05
    means the difference is real, p above it means the runs cannot tell the two apart.
    """
    if total == 0:
        return 1.0
    k = min(faster, total - faster)
    return min(1.0, 2 * sum(math.comb(total, i) for i in range(k + 1)) / 2 ** total)


def ratios_to_gloo(results: list[dict], reference: str = "gloo") -> dict:
    """{(N, size, algorithm): [time / gloo's time, per repetition]} for all-reduce results rows
    (bench/allreduce.py) that ran side by side with gloo (or `reference`), the same number of
    repetitions."""
    gloo = {(r["world_size"], r["size"]): r["times_ms"] for r in results if r["algorithm"] == reference}
    out = {}
    for r in results:
        ref = gloo.get((r["world_size"], r["size"]))
        if r["algorithm"] != reference and ref and len(ref) == len(r["times_ms"]):
            out[r["world_size"], r["size"], r["algorithm"]] = [a / b for a, b in zip(r["times_ms"], ref)]
    return out


def p_text(p: float) -> str:
    """A sign test's p for a report line: small ones as 'p<0.001', not as a rounded 'p=0.00'."""
    return "p<0.001" if p < 0.001 else f"p={p:.3f}" if p < 0.01 else f"p={p:.2f}"


def run_world(script: str, n: int, config: Path, cl, log_name: str, timeout: float, what: str,
              ok_codes=(0,), env: dict | None = None, while_running=None,
              ranks_per_host: int = 1) -> list[subprocess.Popen]:
    """Run ranks 0..n-1 of `script --worker --rank R --config CONFIG` until all have exited.

    With a cluster `cl` (scripts/cluster.py) rank r runs on emulated host r // ranks_per_host with
    GLOO_SOCKET_IFNAME set to its NIC; without, on loopback, where ranks_per_host > 1 fakes the
    hosts for utils/hierarchical.py through RING_HOST_ID. Rank 0's stdout is ours; every rank's stderr (and the
    other ranks' stdout) goes to config's folder / log_name.format(rank=r). If a rank exits with a
    code not in ok_codes, the others get GRACE seconds, then are killed. Every rank is killed on
    every way out. `while_running(procs)` is called about every 0.1 s. Returns the processes;
    raises LaunchError (naming `what`) on a timeout or a failed rank, with each rank's stderr tail.
    """
    procs, logs = [], []
    log_paths = [config.parent / log_name.format(rank=r) for r in range(n)]
    try:
        for r in range(n):
            argv = [sys.executable, "-u", script, "--worker", "--rank", str(r), "--config", str(config)]
            host = r // ranks_per_host
            rank_env = {"GLOO_SOCKET_IFNAME": cl.nic(host) if cl else "lo", "OMP_NUM_THREADS": "1",
                        "PYTHONUNBUFFERED": "1", **({} if cl or ranks_per_host == 1 else {"RING_HOST_ID": str(host)}),
                        **(env or {})}
            log = open(log_paths[r], "wb")
            logs.append(log)
            kw = dict(stdin=subprocess.DEVNULL, stdout=None if r == 0 else log, stderr=log, cwd=REPO)
            if cl:
                procs.append(cl.popen(host, argv, env=rank_env, **kw))
            else:
                procs.append(subprocess.Popen(argv, env={**os.environ, **rank_env}, start_new_session=True, **kw))
        deadline, grace_end = time.monotonic() + timeout, None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                raise LaunchError(f"{what}: timed out after {timeout:.0f}s (--timeout); killed all ranks")
            if grace_end is None and any(p.returncode not in (None, *ok_codes) for p in procs):
                grace_end = now + GRACE
            if grace_end is not None and now > grace_end:
                break
            if while_running:
                while_running(procs)
            time.sleep(0.1)
        codes = [p.returncode for p in procs]
        if any(c not in ok_codes for c in codes):
            tails = []
            for r, path in enumerate(log_paths):
                text = path.read_text(errors="replace").strip().splitlines()
                tails.append(f"--- rank {r} (exit {codes[r]}), last lines of its stderr:\n" + "\n".join(text[-15:]))
            raise LaunchError(f"{what}: ranks exited with {codes}\n" + "\n".join(tails))
        return procs
    finally:
        for p in procs:
            kill_group(p)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for log in logs:
            log.close()


def run_driver(driver, args, prog: str) -> int:
    """driver(args), where SIGTERM, SIGHUP and a second Ctrl-C unwind like the first Ctrl-C, so every
    rank is killed and the cluster torn down on the way out."""
    def on_term(signum, frame):
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)                     # a second signal must not cut teardown short
        raise KeyboardInterrupt(f"signal {signum}")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):   # SIGINT too: shells start background jobs ignoring it
        signal.signal(sig, on_term)
    try:
        return driver(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; killed all ranks", file=sys.stderr)
        return 130
