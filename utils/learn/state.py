"""One rank's training state: everything a checkpoint, a resume, a recovery and a join carry, in
one object, built in one place (state_dict) and restored in one place (load_state_dict).

    state = TrainingState(model, optimizer, scheduler, balance, settings, config)
    state.attach(sync)                 the gradient sum whose per-rank state it carries
    state.stepped(...)                 after each step: the position moves, the step is committed
    state.last, state.before           the last two steps completed (where a lost peer goes on from)
    state.state_dict(everyone)         the checkpoint dict (utils/store/checkpoint.py writes it)
    state.load_state_dict(checkpoint)  a resume, a recovery's or a join's state: the model, Adam,
                                       the schedule, the random state, the sum's per-rank state,
                                       --balance's shares and the position

The position is (epoch, step, EpochStats): continue after `step` of `epoch`, the epoch's sums so
far. The epoch's clock belongs to it too: a change of members mid-epoch does not start it again.
"""

import dataclasses
import time

import torch


@dataclasses.dataclass
class EpochStats:
    """What an epoch's log line reports; carried in mid-epoch checkpoints."""

    loss_sum: float = 0.0
    steps: int = 0
    comm_seconds: float = 0.0  # the step waited for communication this long
    step_seconds: float = 0.0
    busy_seconds: float = 0.0  # communication ran this long (hidden or not)
    bytes_sent: int = 0  # this rank sent this much for gradient sums
    bytes_summed: int = 0  # the summed buffers' size on the wire (compressed)
    images: int = 0  # the steps' images in all, every rank's (each step once)
    own_images: int = 0  # this rank's share of them


# EpochStats' fields that a gradient sum's running totals add to: (field, the sum's stats() key)
COUNTED = (
    ("busy_seconds", "busy_seconds"),
    ("comm_seconds", "waited_seconds"),
    ("bytes_sent", "bytes_sent"),
    ("bytes_summed", "bytes_summed"),
)


@dataclasses.dataclass(frozen=True)
class Position:
    """Where training is: after `step` of `epoch` (step 0: at its start), with the epoch's sums."""

    epoch: int = 1
    step: int = 0
    stats: EpochStats = dataclasses.field(default_factory=EpochStats)

    def copy(self):
        return Position(self.epoch, self.step, dataclasses.replace(self.stats))


class TrainingState:
    """See the module's docstring. settings: what a resume must keep ({flag: value}); config: the
    whole utils.setup.config.Config as a dict, for the record."""

    def __init__(self, model, optimizer, scheduler, balance=None, settings=None, config=None):
        self.model, self.optimizer, self.scheduler, self.balance = model, optimizer, scheduler, balance
        self.settings, self.config = settings or {}, config or {}
        self.sync, self.seen = None, {}  # the gradient sum; what stats already holds of its running totals
        self.position = Position()
        self.last = self.before = self.position
        self.epoch_started = time.time()  # when this rank began the position's epoch
        self.last_seconds, self.last_images = 0.0, (0, 0)  # the last step's time; this rank's images of it, of all

    @property
    def stats(self):
        return self.position.stats

    def attach(self, sync):
        """The gradient sum from now on (at the start, and after every change of members)."""
        self.sync, self.seen = sync, dict(sync.stats())

    def settle(self, final=False):
        """Every update due applied (before evaluating or saving); final: the end of training, the
        same parameters on every rank. The sum's running totals are counted into the epoch's."""
        self.sync.flush() if final else self.sync.finish()
        self.count()

    def count(self):
        now = self.sync.stats()
        for field, key in COUNTED:
            setattr(self.stats, field, getattr(self.stats, field) + now[key] - self.seen[key])
        self.seen = dict(now)

    def stepped(self, step, loss, own, size):
        """`step` is done (committed: a lost peer goes on from it): its loss, this rank's `own` of
        its `size` images."""
        stats = self.stats
        stats.loss_sum, stats.steps = stats.loss_sum + loss, stats.steps + 1
        stats.images, stats.own_images = stats.images + size, stats.own_images + own
        self.last_images = (own, size)
        self.position = dataclasses.replace(self.position, step=step)
        self.before, self.last = self.last, self.position.copy()

    def timed(self, seconds):
        """The step just done took `seconds`, all it took around it included."""
        self.count()
        self.stats.step_seconds += seconds
        self.last_seconds = seconds

    def next_epoch(self):
        self.position = Position(self.position.epoch + 1)
        self.last = self.before = self.position
        self.epoch_started = time.time()

    def epoch_seconds(self):
        return time.time() - self.epoch_started

    def state_dict(self, everyone=None, world_size=None, position=None):
        """The checkpoint dict after `position` (default: the current one). everyone: every rank's
        own gradient-sum state (the sum's has_rank_state), or None; world_size: the ranks it was
        made on. Nothing of an update still due is left out (settle)."""
        position = position or self.position
        shares = self.balance.state(world_size) if self.balance is not None else None
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            "epoch": position.epoch,
            "step": position.step,
            "epoch_stats": dataclasses.asdict(position.stats),
            "world_size": world_size,
            "compression": everyone,
            "settings": self.settings,
            "config": self.config,
            "balance": shares,
        }

    def load_state_dict(self, checkpoint, rank=0, world_size=1, model=True, shares=True):
        """Continue from `checkpoint` (a state_dict(), on this number of ranks or another). model:
        False where the model holds those parameters already (a recovery's source); shares: --balance
        starts from the checkpoint's shares if it was made on as many ranks (False: a new group of
        ranks, from equal shares, until its speeds arrive)."""
        if model:
            self.model.load_state_dict(checkpoint["model"])
        for p in self.model.parameters():  # an abandoned step's gradients must not add to the next one's
            p.grad = None
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        torch.set_rng_state(checkpoint["rng"])
        if checkpoint.get("compression"):
            self.sync.load_states(checkpoint["compression"], rank, world_size)
        if self.balance is not None:
            same = shares and checkpoint.get("world_size") == world_size
            self.balance.restart(rank, world_size, checkpoint.get("balance") if same else None)
        if checkpoint["epoch"] != self.position.epoch:
            self.epoch_started = time.time()  # (a survivor that goes on in its epoch keeps its clock)
        self.position = Position(checkpoint["epoch"], checkpoint["step"], EpochStats(**checkpoint["epoch_stats"]))
        self.last = self.before = self.position.copy()
