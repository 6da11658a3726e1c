"""The CPU time of one training step of the MNIST CNN by batch size, 1 thread: is a step's cost
linear in its images, as --balance's model takes it (utils/balance/shares.py: a cost a step, one an image)?

    python bench/balance/batch_cost.py  # about 20 seconds
    python bench/balance/batch_cost.py --sizes 8,16,48,56 --rounds 5

Sizes take turns in a shuffled order each round (a slow second hits them alike); each figure is
the median over rounds of the median of a size's steps after its first two (a batch of a new size
warms up: bench/balance/NOTES.md).
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # bench/common: harness, stats (run directly)
import torch
from harness import bench_parser

from utils.learn.model import Net

SIZES = "4,8,12,16,24,32,40,44,48,52,54,56,58,60,64"


def step_ms(model, optimizer, images, labels):
    """One forward, backward and optimizer step: its thread CPU milliseconds."""
    started = time.thread_time()
    torch.nn.functional.nll_loss(model(images), labels).backward()
    optimizer.step()
    optimizer.zero_grad()
    return (time.thread_time() - started) * 1000


def main(argv=None):
    ap = bench_parser(__doc__)
    ap.add_argument("--sizes", default=SIZES, help="batch sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="steps a size runs in a round")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.isdigit()]
    if len(sizes) != len(args.sizes.split(",")) or min(sizes) < 1 or args.rounds < 1 or args.steps < 3:
        ap.error("expected --sizes N,N,... (each at least 1), --rounds >= 1, --steps >= 3")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, biggest = Net(), max(sizes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    images, labels = torch.randn(biggest, 1, 28, 28), torch.randint(0, 10, (biggest,))
    for _ in range(30):  # the process's own warm-up
        step_ms(model, optimizer, images[:32], labels[:32])
    runs = {n: [] for n in sizes}
    for rnd in range(args.rounds):
        order = random.Random(rnd).sample(sizes, len(sizes))
        for n in order:
            times = [step_ms(model, optimizer, images[:n], labels[:n]) for _ in range(args.steps)]
            runs[n].append(statistics.median(times[2:]))
    print("| images | ms a step (median) | per round | ms an image |")
    print("|--:|--:|:--|--:|")
    for n in sorted(runs):
        ms = statistics.median(runs[n])
        print(f"| {n} | {ms:.1f} | {', '.join(f'{t:.1f}' for t in runs[n])} | {ms / n:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
