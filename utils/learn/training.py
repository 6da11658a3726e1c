"""One rank's training run, as the loop (utils/run.py) and the elastic wrapper (utils/elastic/recovery.py)
share it: the training state, the gradient sum and its optimizer, the data, the concerns around
each step, and who reports.

    trainer = Trainer(model, data, config, membership, on_step, instruments)
    trainer.start(hosts, resume_from)     a new job's first gradient sum (or a resume's state)
    trainer.new_sync(hosts)               a gradient sum over the group as it is now (a collective)
    trainer.checkpointer.save(state)      rank 0 writes the checkpoint (every rank calls: a collective),
                                          unless something in it is not finite: NotFinite on every rank
"""

import torch
import torch.distributed as dist

from utils.balance.shares import Balance
from utils.comm import hierarchical
from utils.elastic.status import Record
from utils.errors import NotFinite, PeerError, first_line
from utils.exchange import all_gather_json, all_gather_state
from utils.learn.callbacks import (
    Callbacks,
    FiniteLoss,
    Instrumented,
    OnStep,
    Rebalancing,
    SaveEvery,
    StepProbe,
    StopSignals,
    TimelineWindow,
    Watching,
)
from utils.learn.data import BalancedBatches, step_batches
from utils.learn.optim import Adam, OneCycleLR
from utils.learn.state import TrainingState
from utils.observe.board import Board
from utils.observe.instruments import OFF as INSTRUMENTS_OFF
from utils.observe.report import EpochReport, start_line
from utils.observe.watch import Watch
from utils.setup.distributed import model_name
from utils.setup.threads import ServerShare
from utils.store import checkpoint
from utils.sync.factory import make_gradient_sync
from utils.sync.interface import DistributedOptimizer
from utils.timeline import OFF, Recorder


def make_optimizer(model, recipe, steps_per_epoch):
    """Adam with a one-cycle learning rate over the whole run (warm up, then anneal): utils/learn/optim.py,
    torch.optim's sums without its start-up cost."""
    optimizer = Adam(model.parameters(), lr=recipe.lr)
    scheduler = OneCycleLR(optimizer, max_lr=recipe.lr, total_steps=recipe.epochs * steps_per_epoch, pct_start=0.15)
    return optimizer, scheduler


def batches_of_epoch(num_examples, epoch, recipe, balance=None):
    """This rank's (batch, weight, images of the step in all) for every step of `epoch`
    (utils.learn.data.step_batches; --balance: utils.learn.data.BalancedBatches); the weight is its
    share of the step's images times N, so the average over ranks weighs every image alike."""
    if balance is not None:
        return BalancedBatches(num_examples, epoch, recipe.seed, recipe.global_batch, balance)
    n = dist.get_world_size()
    batches, sizes = step_batches(num_examples, epoch, dist.get_rank(), n, recipe.seed, recipe.global_batch)
    return [
        (batch, 1.0 if len(batch) * n == size else len(batch) * n / size, size) for batch, size in zip(batches, sizes)
    ]


class Checkpointer:
    """Rank 0 writes the checkpoint of the training state (every rank calls save: the state may
    hold every rank's own part of the sum, gathered first), and never one with a NaN or an inf."""

    def __init__(self, path, timeline=OFF, instruments=INSTRUMENTS_OFF):
        self.path, self.timeline, self.instruments = path, timeline, instruments

    def save(self, state):
        """Mid-epoch (--save-every, a stop): the parts gathered, then looked at, with no collective of
        its own for the look (one beside a joining server's growth slowed its join from 6 s to 150 s,
        tests/world/test_balance.py; why, not yet known)."""
        state.settle()
        everyone = self.gather(state)
        self.refuse_non_finite(state, self.scan(state, None) or self.scan_ranks(everyone))
        self.write(state, everyone)

    def check_finite(self, state):
        """Every update due applied; NotFinite on every rank if the model, Adam's state or any rank's own
        part of the sum holds a NaN or an inf. Each rank scans its own values (a scan of every value: at
        a save only) and only the names of what they found cross the wire, so that what must come first
        at an epoch's end (this check, then rank 0's report) waits for a few bytes, not for gather's
        copies of every rank's state: at 20 Mbit/s those take seconds under --sync-every."""
        state.settle()
        found = self.scan(state, state.sync.state_dict() if state.sync.has_rank_state else None)
        try:
            found = next((name for name in all_gather_json(found) if name is not None), None)
        except RuntimeError as e:
            raise PeerError(first_line(e), doing="saving a checkpoint") from None
        self.refuse_non_finite(state, found)

    @staticmethod
    def scan(state, own):
        """The first non-finite value's name in the model, Adam's state or this rank's part `own`, or None."""
        parts = {"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()}
        return checkpoint.not_finite(parts, "") or checkpoint.not_finite(own, f".ranks.{dist.get_rank()}")

    @staticmethod
    def scan_ranks(everyone):
        """The first non-finite value's name in every rank's part (gather's), or None."""
        found = (checkpoint.not_finite(part, f".ranks.{r}") for r, part in enumerate(everyone or ()))
        return next((name for name in found if name is not None), None)

    @staticmethod
    def refuse_non_finite(state, found):
        if found is not None:
            where = f"epoch {state.position.epoch}, step {state.position.step}"
            raise NotFinite(f"the parameters are not finite after {where} ({found[1:]} holds a NaN or an inf)")

    def gather(self, state):
        """Every rank's own part of the sum (None: the sum keeps none), gathered for rank 0 to write
        (save looks at them itself; an epoch's end has run check_finite first)."""
        if not state.sync.has_rank_state:
            return None
        try:
            return all_gather_state(state.sync.state_dict())
        except RuntimeError as e:
            raise PeerError(first_line(e), doing="saving a checkpoint") from None

    def write(self, state, everyone):
        """Rank 0 writes the checkpoint of `state` with every rank's part (gather's)."""
        self.instruments.point("save")
        if dist.get_rank() == 0:
            with self.timeline.span("checkpoint"):
                checkpoint.save(state.state_dict(everyone, dist.get_world_size()), self.path)


class Trainer:
    """What every epoch of one rank's run uses. model, data (train images, labels, test images,
    labels), config: as given; membership: this rank's utils.elastic.membership.Membership (None:
    a lost rank stops the job); on_step: called after every step; instruments: the tests' and
    benchmarks' (utils/observe/instruments.py)."""

    def __init__(self, model, data, config, membership=None, on_step=None, instruments=INSTRUMENTS_OFF):
        self.model, self.data, self.config, self.membership = model, data, config, membership
        recipe, outputs = config.recipe, config.outputs
        self.steps_per_epoch = len(batches_of_epoch(len(data[1]), 1, recipe))
        self.balance = None  # --balance: the shares of each step (utils/balance/shares.py)
        if config.sync.balance:
            rank, world_size, threads = dist.get_rank(), dist.get_world_size(), torch.get_num_threads()
            self.balance = Balance(config.sync.balance, rank, world_size, recipe.global_batch, threads)
        optimizer, scheduler = make_optimizer(model, recipe, self.steps_per_epoch)
        settings = {"model": model_name(model), **config.must_keep()}
        self.state = TrainingState(model, optimizer, scheduler, self.balance, settings, config.to_dict())
        self.timeline = OFF  # rank 0 was given --timeline (utils.setup.distributed.agree): every rank records
        if outputs.timeline_steps:
            self.timeline = Recorder(outputs.timeline, *outputs.timeline_steps, recipe.epochs * self.steps_per_epoch)
        self.watch = self.make_watch()
        self.checkpointer = Checkpointer(outputs.checkpoint, self.timeline, instruments)
        self.callbacks = self.make_callbacks(on_step, instruments)
        self.report = EpochReport(config, self.watch, self.members, self.balance, self.steps_per_epoch, len(data[3]))
        self.cores = ServerShare()  # this rank's torch threads: its share of its server's cores
        self.sync = self.optimizer = self.accuracy = None

    def make_watch(self):
        """Who watches: this rank's progress record (its heartbeats carry it: --status), rank 0's curves."""
        outputs = self.config.outputs
        board = (lambda at: Board(outputs.tensorboard, at)) if outputs.tensorboard else None  # rank 0 opens it
        return Watch(Record(self.config.recipe.epochs), board, lambda: self.state.optimizer.param_groups[0]["lr"])

    def make_callbacks(self, on_step, instruments):
        steps, outputs, balance = self.steps_per_epoch, self.config.outputs, self.balance
        rank_0 = lambda: dist.get_rank() == 0  # noqa: E731 (a survivor may become rank 0)
        return Callbacks(
            OnStep(on_step) if on_step else None,
            Instrumented(instruments, steps) if instruments.enabled else None,
            StopSignals(),
            FiniteLoss(),
            Rebalancing(balance, self.timeline, self.watch, instruments, steps) if balance is not None else None,
            Watching(self.watch, rank_0, steps, self.members),
            SaveEvery(outputs.save_every, self.checkpointer, steps) if outputs.save_every else None,
            TimelineWindow(self.timeline, steps),
            probe=StepProbe(self.timeline, balance, instruments),
        )

    def members(self):
        """The ids of the ranks in the job now (for metrics.jsonl and the curves)."""
        return list(self.membership.members) if self.membership is not None else list(range(dist.get_world_size()))

    def batches(self, epoch):
        return batches_of_epoch(len(self.data[1]), epoch, self.config.recipe, self.balance)

    def start(self, hosts, resume_from=None):
        """A job's first gradient sum, over `hosts` (utils.comm.hierarchical.discover); rank 0 says
        what is trained. resume_from: a checkpoint dict (the same on every rank) to continue from."""
        self.new_sync(hosts)
        if dist.get_rank() == 0:
            layout = f"{hierarchical.describe(hosts)}, {self.cores.describe()}"
            print(start_line(self.config, self.model, self.data, layout, self.sync), flush=True)
            if self.sync.note():
                print(self.sync.note(), flush=True)
        if resume_from is not None:
            self.restore(resume_from)
            if self.balance is not None and resume_from.get("balance") and dist.get_rank() == 0:
                if resume_from.get("world_size") == dist.get_world_size():
                    print(f"shares from the checkpoint: {'/'.join(map(str, self.balance.shares()))}", flush=True)

    def restore(self, state, model=True, shares=True):
        """Go on from `state` (a checkpoint dict: a resume's, a recovery's or a join's) on this group
        (utils.learn.state.TrainingState.load_state_dict: model, shares)."""
        self.state.load_state_dict(state, dist.get_rank(), dist.get_world_size(), model, shares)

    def new_sync(self, hosts):
        """A gradient sum over the default group as it is now (a collective); hosts: the servers'
        ranks. It and its DistributedOptimizer replace the ones before."""
        self.cores.follow()  # (who shares this rank's server may have changed)
        if self.balance is not None:
            self.balance.threads = torch.get_num_threads()
        broken = self.membership.broken if self.membership is not None else None
        state, config = self.state, self.config
        self.sync = make_gradient_sync(
            self.model, config.sync, state.optimizer, state.scheduler, config.recipe.seed, hosts, self.timeline, broken
        )
        self.optimizer = DistributedOptimizer(self.sync)
        state.attach(self.sync)
        return self.sync

    def close(self):
        self.sync.close()
        self.watch.close()
