"""What happens around the training steps, one small object per concern, each called once per step
by the loop (utils/run.py's train_steps), in the order they are given:

    training_goes_on(state)                 training starts, or goes on after a change of members
    epoch_begins(state, steps)              before an epoch's steps (or what is left of them)
    step_begins(state, step)                before a step
    flags(flags) -> flags                   this rank's flags for the step's sum (stop, join, speed, NaN)
    step_ends(state, step, flags)           after it (the state holds what it did): the flags every
                                            rank raised with its sum
    steps_end(state)                        the epoch's steps are over (or broke off)

Callbacks(...) calls them in turn; `probe` is what train_step marks (StepProbe: the timeline's
spans, --balance's clock, the instruments' "sum" point). A concern that needs the parameters
final (a save, a timeline's window) asks the state to settle them: the loop knows no kind of sum.
"""

import contextlib
import dataclasses
import math
import time

from utils.balance.shares import REVIEW
from utils.observe.instruments import OFF as INSTRUMENTS_OFF
from utils.observe.report import Progress
from utils.setup import stop
from utils.sync.flags import NO_FLAGS
from utils.timeline import OFF


class Callback:
    """A concern that does nothing; each concern overrides what it needs."""

    def training_goes_on(self, state):
        pass

    def epoch_begins(self, state, steps):
        pass

    def step_begins(self, state, step):
        pass

    def flags(self, flags):
        return flags

    def step_ends(self, state, step, flags):
        pass

    def steps_end(self, state):
        pass


class Untimed:
    """A step's clock when nothing times the steps (--balance times them: utils/balance/shares.py)."""

    def start(self):
        pass

    def computed(self):
        pass

    def ended(self, images):
        pass


class StepProbe:
    """What train_step marks: the timeline's spans, the clock (start, computed, ended), and the
    instruments' "sum" point (after backward, before the sum)."""

    def __init__(self, timeline=OFF, clock=None, instruments=INSTRUMENTS_OFF):
        self.timeline, self.clock, self.instruments = timeline, clock or Untimed(), instruments

    @contextlib.contextmanager
    def step(self, images):
        self.clock.start()
        with self.timeline.span("step"):
            yield
        self.clock.ended(images)

    def span(self, name):
        return self.timeline.span(name)

    def computed(self):
        self.clock.computed()
        self.instruments.point("sum")


UNPROBED = StepProbe()


class Callbacks:
    """The concerns, called in turn; `step_seconds` times each step, the concerns' work included."""

    def __init__(self, *callbacks, probe=UNPROBED):
        self.callbacks, self.probe = [c for c in callbacks if c is not None], probe
        self.started = None

    def training_goes_on(self, state):
        for c in self.callbacks:
            c.training_goes_on(state)

    def add(self, callback):
        """One more concern, called after the others."""
        self.callbacks.append(callback)

    def epoch_begins(self, state, steps):
        for c in self.callbacks:
            c.epoch_begins(state, steps)

    def step_begins(self, state, step):
        self.started = time.perf_counter()
        for c in self.callbacks:
            c.step_begins(state, step)

    def flags(self):
        flags = NO_FLAGS
        for c in self.callbacks:
            flags = c.flags(flags)
        return flags

    def step_ends(self, state, step, flags):
        state.timed(time.perf_counter() - self.started)
        for c in self.callbacks:
            c.step_ends(state, step, flags)

    def steps_end(self, state):
        for c in self.callbacks:
            c.steps_end(state)


class StopSignals(Callback):
    """A signal this rank got (utils/setup/stop.py) rides with the next step's sum."""

    def flags(self, flags):
        return dataclasses.replace(flags, signalled=1) if stop.signalled() else flags


class FiniteLoss(Callback):
    """A non-finite loss stops the job (utils/run.py). The step's own rides with its sum (train_step
    tells the sync); this keeps raising it with every step after, for a sum that carries the flags
    only now and then (--sync-every: at a round's merge)."""

    def __init__(self):
        self.seen = False

    def flags(self, flags):
        return dataclasses.replace(flags, not_finite=True) if self.seen else flags

    def step_ends(self, state, step, flags):
        self.seen = self.seen or not math.isfinite(state.stats.loss_sum)


class Rebalancing(Callback):
    """--balance (utils/balance/shares.py): this rank's speed codes ride with each step's sum; every
    REVIEW steps the shares are looked at, and a change is drawn and shown."""

    def __init__(self, balance, timeline, watch, instruments, steps_per_epoch):
        self.balance, self.timeline, self.watch, self.instruments = balance, timeline, watch, instruments
        self.steps_per_epoch = steps_per_epoch

    def flags(self, flags):
        return dataclasses.replace(flags, speeds=self.balance.slots())

    def step_ends(self, state, step, flags):
        epoch, balance = state.position.epoch, self.balance
        if balance.review(step, flags.speeds):
            now = self.timeline.now_ns()
            self.timeline.add("re-balance", now, now, shares="/".join(map(str, balance.shares())))
            self.watch.rebalanced((epoch - 1) * self.steps_per_epoch + step, balance.shares())
        if step % REVIEW == 0:  # (bench/balance/balance.py: the shares over time)
            self.instruments.log(event="shares", epoch=epoch, step=step, shares=balance.shares(), speeds=flags.speeds)


class Watching(Callback):
    """Rank 0's progress lines, and what every rank shows those who watch the job (--status,
    --tensorboard: a utils.observe.watch.Watch). steps_per_epoch: for the global step."""

    def __init__(self, watch, rank_0, steps_per_epoch, members):
        self.watch, self.rank_0, self.steps_per_epoch, self.members = watch, rank_0, steps_per_epoch, members
        self.progress = None

    def training_goes_on(self, state):
        at = (state.position.epoch - 1) * self.steps_per_epoch + state.position.step
        self.watch.members(self.members(), at, self.rank_0())

    def epoch_begins(self, state, steps):
        position = state.position
        self.progress = Progress(position.epoch, position.step, steps, self.rank_0(), state.epoch_started)
        self.watch.begin(position.epoch, state.stats)

    def step_ends(self, state, step, flags):
        stats = state.stats
        self.progress.update(step, stats.loss_sum / stats.steps)
        own, size = state.last_images
        self.watch.step(state.position.epoch, step, self.progress.total, own, size, state.last_seconds, stats)

    def steps_end(self, state):
        if self.progress is not None:
            self.progress.close()


class TimelineWindow(Callback):
    """--timeline: the step numbers, and the trace written when its window of steps ends."""

    def __init__(self, timeline, steps_per_epoch):
        self.timeline, self.steps_per_epoch = timeline, steps_per_epoch

    def step_begins(self, state, step):
        self.timeline.at_step((state.position.epoch - 1) * self.steps_per_epoch + step)

    def step_ends(self, state, step, flags):
        if not flags.interrupting and self.timeline.window_ends():
            state.settle()  # the window's last step's sums in the trace
            self.timeline.write()


class SaveEvery(Callback):
    """--save-every N: the checkpoint every N steps of an epoch (not at its last: the epoch's own)."""

    def __init__(self, every, checkpointer, steps_per_epoch):
        self.every, self.checkpointer, self.steps_per_epoch = every, checkpointer, steps_per_epoch

    def step_ends(self, state, step, flags):
        if step % self.every == 0 and step < self.steps_per_epoch and not flags.interrupting:
            self.checkpointer.save(state)


class OnStep(Callback):
    """Calls `call()` after every step (a keeper's child tells it that it trains: utils/setup/keeper.py)."""

    def __init__(self, call):
        self.call = call

    def step_ends(self, state, step, flags):
        self.call()


class Instrumented(Callback):
    """The instruments' step faults (utils/observe/instruments.py), at each step's start."""

    def __init__(self, instruments, steps_per_epoch):
        self.instruments, self.steps_per_epoch = instruments, steps_per_epoch

    def step_begins(self, state, step):
        self.instruments.at_step((state.position.epoch - 1) * self.steps_per_epoch + step, state.model)
