"""One rank alone in a real gloo group, training a tiny --sync-every 2 epoch through the loop
(utils.run.train_epochs): the order of the epoch end's calls, printed as JSON (tests/world/test_epoch_report.py)."""

import json
import sys

import torch
import torch.distributed as dist

from utils.learn.model import Net
from utils.learn.training import Trainer
from utils.run import train_epochs
from utils.setup.cli import parse_args
from utils.setup.config import from_args


def recording(order, name, call):
    def recorded(*args, **kwargs):
        order.append(name)
        return call(*args, **kwargs)

    return recorded


def main(folder):
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    args = ["--rank", "0", "--world-size", "1", "--init-method", "tcp://127.0.0.1:1", "--epochs", "1"]
    args += ["--train-subset", "256", "--test-subset", "64", "--sync-every", "2", "--metrics", f"{folder}/m.jsonl"]
    config = from_args(parse_args([*args, "--checkpoint", f"{folder}/c.pt", "--save-path", f"{folder}/m.pth"]))
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(320, 1, 28, 28, generator=g), torch.randint(0, 10, (320,), generator=g)
    trainer = Trainer(Net(), (images[:256], labels[:256], images[256:], labels[256:]), config)
    trainer.start([[0]])
    order = []
    trainer.report.epoch = recording(order, "report", trainer.report.epoch)
    trainer.checkpointer.check_finite = recording(order, "check_finite", trainer.checkpointer.check_finite)
    trainer.checkpointer.gather = recording(order, "gather", trainer.checkpointer.gather)
    train_epochs(trainer)
    print(json.dumps({"order": order, "sync": type(trainer.sync).__name__}))


if __name__ == "__main__":
    main(sys.argv[1])
