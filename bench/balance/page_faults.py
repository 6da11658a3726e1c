"""The MNIST CNN's training steps, with glibc's malloc as it comes and with the limits train.py
sets (utils/setup/memory.py): ms a step and page faults a step, at 56 images from the start and after 10
steps at 32 (as when --balance moves a rank's share). Each run is a process of its own, 1 thread.

    python bench/balance/page_faults.py  # about 90 seconds
    python bench/balance/page_faults.py --rounds 10
    python bench/balance/page_faults.py --rounds 1 --steps 10   # short: the tests'

The four runs of a round take turns in a shuffled order; a run's figures are medians over its
last --steps steps at 56 (wall-clock ms, minor page faults), after 50 at 56 before them, and each
figure here the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # bench/common: harness, stats (run directly)
from harness import bench_parser

FULL, WARM = 56, 50  # images a step once grown; steps at FULL before the measured ones
PLANS = {"56 from the start": [], "32 for 10 steps, then 56": [32] * 10}  # the steps before the 56s


def run(plan, keep, steps):
    """One run, in this process: its ms and its page faults of each of its last `steps` steps."""
    import torch
    import torch.nn.functional as F

    from utils.learn.model import Net
    from utils.setup.memory import keep_freed_memory

    if keep and not keep_freed_memory():
        raise SystemExit("page_faults.py: mallopt is not there: not glibc")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sizes = PLANS[plan] + [FULL] * (WARM + steps)
    images, labels = torch.randn(FULL, 1, 28, 28), torch.randint(0, 10, (FULL,))
    ms, faults = [], []
    for size in sizes:
        before, started = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        F.cross_entropy(model(images[:size]), labels[:size]).backward()
        optimizer.step()
        optimizer.zero_grad()
        ms.append((time.perf_counter() - started) * 1000)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return ms[-steps:], faults[-steps:]


def main(argv=None):
    ap = bench_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50, help="steps measured in each run (default 50)")
    ap.add_argument("--run", help=argparse.SUPPRESS)  # one run, in this process: PLAN:KEEP
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("expected --steps >= 1")
    if args.run:
        plan, _, keep = args.run.rpartition(":")
        if plan not in PLANS or keep not in ("0", "1"):
            ap.error(f"--run: expected PLAN:0 or PLAN:1 (PLAN one of {', '.join(PLANS)}), not {args.run!r}")
        print(json.dumps(run(plan, keep == "1", args.steps)))
        return 0
    if args.rounds < 1:
        ap.error("expected --rounds >= 1")
    configs = [(plan, keep) for keep in ("0", "1") for plan in PLANS]
    results = {config: [] for config in configs}
    for rnd in range(args.rounds):
        for plan, keep in random.Random(rnd).sample(configs, len(configs)):
            child = [sys.executable, __file__, "--run", f"{plan}:{keep}", "--steps", str(args.steps)]
            out = subprocess.run(child, capture_output=True, text=True, timeout=300)
            if out.returncode != 0:
                last = (out.stderr.strip().splitlines() or ["no output"])[-1]
                sys.exit(f"page_faults.py: the run {plan!r}:{keep} failed: {last}")
            results[plan, keep].append([statistics.median(column) for column in json.loads(out.stdout)])
    print("| malloc | images a step | ms a step (median) | page faults a step | per round (ms, faults) |")
    print("|:--|:--|--:|--:|:--|")
    for plan, keep in configs:
        each = results[plan, keep]
        ms, faults = (statistics.median(column) for column in zip(*each))
        rounds = ", ".join(f"{m:.1f} ms {f:.0f}" for m, f in each)
        print(f"| {'limits set' if keep == '1' else 'as it comes'} | {plan} | {ms:.1f} | {faults:.0f} | {rounds} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
