"""What the control plane costs a training run: its threads' CPU, and the share of it that signing takes.

    python bench/fuzz/control_cost.py                  3 ranks, one epoch of 19,200 images, default flags
    python bench/fuzz/control_cost.py --ranks 4 --train-subset 60000

Part 1 runs `python train.py` with the original per-server command; every rank logs, at the end,
the CPU seconds of its two control-plane threads (heartbeats and inbox: utils/elastic/detector.py)
and of the whole process, as an event (RING_INSTRUMENTS: utils/observe/instruments.py). Part 2
times one heartbeat's journey, sealed and opened, side by side with and without authentication:
the same message as plain JSON with the same checks, against it signed with HMAC-SHA256 and its
counter checked (utils/elastic/wire.py).
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # bench/common: harness, stats (run directly)
import fuzz  # (the job's start: one process per rank, the original command)
import harness  # noqa: F401  (first: puts the repository's utils/ on the path)

from utils.elastic.wire import KINDS, Alive, Envelope
from utils.observe.instruments import VARIABLE, environ_for, read_events
from utils.setup.launch import supervise


def plain_round_trip(message):
    """The message as it went before it was signed: JSON out, JSON in, the same field checks."""
    body = json.dumps({"kind": "alive", "job": "00ff", "from": 1, "to": 0, **dataclasses.asdict(message)}).encode()
    fields = json.loads(body)
    fields.pop("from"), fields.pop("to"), fields.pop("job")
    return KINDS[fields.pop("kind")].parse(fields)


def signed_round_trip(sender, receiver, message):
    return receiver.open(sender.seal(message, to=0))[2]


def per_message_us(repeats, rounds=15):
    """Median microseconds per message, (plain, signed), timed in alternating rounds."""
    message, key = Alive(7, "training", None, 0, None), os.urandom(32)
    sender, receiver = Envelope(key, 1), Envelope(key, 0)
    plain, signed = [], []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(repeats):
            plain_round_trip(message)
        plain.append((time.process_time() - start) / repeats * 1e6)
        start = time.process_time()
        for _ in range(repeats):
            signed_round_trip(sender, receiver, message)
        signed.append((time.process_time() - start) / repeats * 1e6)
    return statistics.median(plain), statistics.median(signed)


def run_and_read(ranks, args, timeout):
    folder = tempfile.mkdtemp(prefix="control-cost-")
    events = os.path.join(folder, "events.jsonl")
    os.environ.update(environ_for(events=events))
    try:
        procs = fuzz.start(folder, fuzz.free_port(), ranks, args)
        outcome = supervise(procs, timeout=timeout, poll=0.2)
    finally:
        del os.environ[VARIABLE]
    rows = [e for e in read_events(events) if e["event"] == "control-plane"]
    return [p.returncode for p in procs], rows, outcome.outputs[0][0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--train-subset", type=int, default=19200)
    p.add_argument("--repeats", type=int, default=2000, help="messages a round in part 2 (default %(default)s)")
    p.add_argument("--timeout", type=float, default=900.0)
    a = p.parse_args(argv)
    args = ["--epochs", "1", "--train-subset", str(a.train_subset), "--test-subset", "500", "--timeout", "60"]
    codes, rows, out = run_and_read(a.ranks, args, a.timeout)
    if codes != [0] * a.ranks or len(rows) != a.ranks:
        print(f"FAIL: exit codes {codes}, {len(rows)} ranks logged\n{out[-2000:]}")
        return 1
    print(f"part 1: {a.ranks} ranks, {a.train_subset:,} images, default flags (heartbeat 5 s)")
    print("| rank | control-plane CPU (s) | the rank's CPU (s) | share |")
    print("|---|---|---|---|")
    shares = []
    for row in sorted(rows, key=lambda r: r["rank"]):
        control = sum(row["cpu"].values())
        shares.append(control / row["process_cpu"])
        print(f"| {row['rank']} | {control:.3f} | {row['process_cpu']:.1f} | {100 * shares[-1]:.3f}% |")
    plain, signed = per_message_us(a.repeats)
    print(f"\npart 2: one heartbeat sealed and opened, median of 15 rounds of {a.repeats:,}")
    print(f"  plain JSON with the same checks: {plain:.1f} µs; signed and checked: {signed:.1f} µs")
    print(f"  signing adds {signed - plain:.1f} µs a message")
    worst = max(shares)
    print(f"\nthe control plane: at most {100 * worst:.3f}% of a rank's CPU (target ≤ 1%)")
    return 0 if worst <= 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
