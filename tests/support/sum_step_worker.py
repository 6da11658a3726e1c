"""One rank, a world of its own, for tests/world/test_sum_step.py: a bucket's sum whose thread starts
only after the training thread has begun the next step (as under load with --lazy-update, whose
next step begins before its sums are waited for). Prints the step each span of a sum was drawn in,
by name ("sum", and the "all-reduce" inside it)."""

import json
import sys
import threading

import torch
import torch.distributed as dist

from utils.learn.model import Net
from utils.setup.config import Sync
from utils.sync import buckets
from utils.sync.factory import make_gradient_sync
from utils.timeline import Recorder


def main(port, trace):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    gate, average = threading.Event(), buckets.average_gradients

    def late(*args, **kw):  # each bucket's thread is held until the next step has begun
        gate.wait(30)
        return average(*args, **kw)

    buckets.average_gradients = late
    timeline = Recorder(trace, first=1, last=2, total_steps=2)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = make_gradient_sync(model, Sync(bucket_mb=0.05), optimizer, None, timeline=timeline)
    timeline.at_step(1)
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    timeline.at_step(2)
    gate.set()
    sync.sum()
    drawn = {name: [] for name in ("sum", "all-reduce")}
    for name, _, _, _, args in timeline.spans:
        drawn.setdefault(name, []).append(args["step"])
    print(json.dumps(drawn))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
