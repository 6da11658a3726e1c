"""One rank's training run, as the epoch loop (utils/run.py) and live recovery (utils/elastic/recovery.py)
share it: the model and what steps it, the data, the outputs, and who watches.

    trainer = Trainer(model, data, config, membership)
    trainer.sync = trainer.new_sync(hosts)      the gradient sum (a new one after a change of members)
    trainer.state(epoch, step, stats)           this rank's checkpoint dict
    trainer.save_checkpoint(epoch, step, stats) rank 0 writes it (every rank calls: a collective)
    Steps(model, sync, images, labels, ...)     what one epoch's steps use (utils.run.train_model)
"""

import dataclasses

import torch
import torch.distributed as dist

from utils.balance.shares import Balance
from utils.elastic import faults
from utils.elastic.status import Record
from utils.errors import PeerError, first_line
from utils.exchange import all_gather_state
from utils.learn.data import BalancedBatches, step_batches
from utils.learn.optim import Adam, OneCycleLR
from utils.observe.board import Board
from utils.observe.watch import Watch
from utils.setup import stop
from utils.setup.distributed import model_name
from utils.store import checkpoint
from utils.sync.factory import make_gradient_sync
from utils.sync.flags import Flags
from utils.sync.interface import GradientSync
from utils.timeline import OFF, Recorder


def make_optimizer(model, recipe, steps_per_epoch):
    """Adam with a one-cycle learning rate over the whole run (warm up, then anneal): utils/learn/optim.py,
    torch.optim's sums without its start-up cost."""
    optimizer = Adam(model.parameters(), lr=recipe.lr)
    scheduler = OneCycleLR(optimizer, max_lr=recipe.lr, total_steps=recipe.epochs * steps_per_epoch, pct_start=0.15)
    return optimizer, scheduler


def batches_of_epoch(num_examples, epoch, recipe, balance=None):
    """This rank's (batch, weight, images of the step in all) for every step of `epoch`
    (utils/data.step_batches; --balance: utils/data.BalancedBatches); the weight is its share of
    the step's images times N, so the average over ranks weighs every image alike."""
    if balance is not None:
        return BalancedBatches(num_examples, epoch, recipe.seed, recipe.global_batch, balance)
    n = dist.get_world_size()
    batches, sizes = step_batches(num_examples, epoch, dist.get_rank(), n, recipe.seed, recipe.global_batch)
    return [
        (batch, 1.0 if len(batch) * n == size else len(batch) * n / size, size) for batch, size in zip(batches, sizes)
    ]


def stop_flag(membership=None, balance=None):
    """This rank's flags for the next sum: a signal it got; on the leader, a server waiting to join
    (utils/elastic/membership.py), so that every rank learns of it at one step; --balance: its speed."""
    return Flags(
        signalled=1 if stop.signalled() else 0,
        joining=membership is not None and membership.wants_growth(),
        speeds=balance.slots() if balance is not None else (),
    )


class Untimed:
    """A step's clock when nothing times the steps (--balance times them: utils/balance/shares.py)."""

    def start(self):
        pass

    def computed(self):
        pass

    def ended(self, images):
        pass


UNTIMED = Untimed()


@dataclasses.dataclass
class Steps:
    """What an epoch's steps use (train_model): the model, its gradient sum, the training images;
    and, as the run has them, the timeline, --balance (utils/balance/shares.py: it times each step and
    reviews the shares), who watches (a utils.observe.watch.Watch, told each step's progress), and the
    checkpoint's save(epoch, step, stats) every save_every steps."""

    model: torch.nn.Module
    sync: GradientSync
    images: torch.Tensor
    labels: torch.Tensor
    timeline: object = OFF
    balance: object = None
    watch: object = None
    save: object = None
    save_every: int = 0

    @property
    def clock(self):
        """What times each step (train_step marks it): --balance, or nobody."""
        return self.balance if self.balance is not None else UNTIMED


class Trainer:
    """What every epoch of one rank's run uses. model, data (train images, labels, test images,
    labels), config: as given; membership: this rank's utils.elastic.membership.Membership (None:
    a lost rank stops the job). sync: the gradient sum in use, set by whoever makes it."""

    def __init__(self, model, data, config, membership=None):
        self.model, self.data, self.config, self.membership = model, data, config, membership
        recipe, outputs = config.recipe, config.outputs
        self.steps_per_epoch = len(batches_of_epoch(len(data[1]), 1, recipe))
        self.balance = None  # --balance: the shares of each step (utils/balance/shares.py)
        if config.sync.balance:
            rank, world_size, threads = dist.get_rank(), dist.get_world_size(), torch.get_num_threads()
            self.balance = Balance(config.sync.balance, rank, world_size, recipe.global_batch, threads)
        self.optimizer, self.scheduler = make_optimizer(model, recipe, self.steps_per_epoch)
        self.timeline = OFF  # rank 0 was given --timeline (utils/distributed.agree): every rank records
        if outputs.timeline_steps:
            self.timeline = Recorder(outputs.timeline, *outputs.timeline_steps, recipe.epochs * self.steps_per_epoch)
        self.settings = {"model": model_name(model), **config.must_keep()}
        self.sync = None  # a joining server makes its own with the members (Recovery.form)
        self.hint = None  # rank 0's utils.observe.report.SlowRankHint, once this rank's place is known (run)
        self.record = Record(recipe.epochs)  # this rank's progress: its heartbeats carry it (train.py --status)
        board = (lambda at: Board(outputs.tensorboard, at)) if outputs.tensorboard else None  # rank 0 opens it
        self.watch = Watch(self.record, board, lambda: self.optimizer.param_groups[0]["lr"])

    def batches(self, epoch):
        return batches_of_epoch(len(self.data[1]), epoch, self.config.recipe, self.balance)

    def new_group(self, shares=None):
        """The ranks are a new group (a resume, a join, a lost rank): --balance starts again from
        equal shares, or from a checkpoint's `shares`, until the new group's speeds arrive."""
        if self.balance is not None:
            self.balance.restart(dist.get_rank(), dist.get_world_size(), shares)

    def new_sync(self, hosts):
        """A gradient sum over the default group as it is now (a collective); hosts: the servers' ranks."""
        broken = self.membership.broken if self.membership is not None else None
        flags = lambda: stop_flag(self.membership, self.balance)  # noqa: E731
        return make_gradient_sync(
            self.model, self.config.sync, self.optimizer, self.scheduler, self.config.recipe.seed, flags, hosts,
            self.timeline, broken,
        )  # fmt: skip

    def state(self, epoch, step, stats, everyone=None, world_size=None):
        """The checkpoint dict of this rank after `step` of `epoch` (everyone: every rank's own
        gradient-sync state; world_size: the ranks it was made on, if the group is gone)."""
        world_size = world_size or dist.get_world_size()
        shares = self.balance.state(world_size) if self.balance is not None else None
        return checkpoint.training_state(
            self.model, self.optimizer, self.scheduler, epoch, step, dataclasses.asdict(stats), world_size,
            everyone, self.settings, self.config.to_dict(), shares,
        )  # fmt: skip

    def save_checkpoint(self, epoch, step, stats):
        """Rank 0 writes everything needed to continue after `step` of `epoch` (every rank calls it:
        the checkpoint may hold every rank's own state, sync.has_rank_state)."""
        everyone = [None] * dist.get_world_size()
        if self.sync.has_rank_state:
            try:
                everyone = all_gather_state(self.sync.state_dict())
            except RuntimeError as e:
                raise PeerError(first_line(e), doing="saving a checkpoint") from None
        faults.point("save")
        if dist.get_rank() == 0:
            with self.timeline.span("checkpoint"):
                everyone = everyone if self.sync.has_rank_state else None
                checkpoint.save(self.state(epoch, step, stats, everyone), self.config.outputs.checkpoint)
