"""The one interface of every gradient sync (the flags that ride along with its sums: flags.py).

The training loop (utils/run.py) holds a GradientSync and the DistributedOptimizer made for it,
and calls, for every step:

    sync.begin(w, flags)     this rank's share of the step's images times N, and its Flags
    sync.not_finite()        (after the forward, if the loss is NaN or inf: every rank learns of it)
    loss.backward()
    sync.sum()               the ring sum over all ranks (overlapped kinds: already running)
    optimizer.step()         the optimizer's step, as this kind of sum calls for it (DistributedOptimizer)
    sync.flags()             what the ranks raised with this step's sum (the same Flags everywhere)

The training state (utils/learn/state.py) calls, now and then, optimizer.settle() (before
evaluating or saving) and optimizer.flush() (the end of training), and stats(), state_dict() /
load_state_dict() (the checkpoint); the elastic wrapper close() and abandon() (after a lost
peer). What differs between the kinds is asked of the object: has_rank_state, note(), and its
compressor (describe(), compresses). Every kind waits for a sum on another thread with wait_for.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
import time

from utils.errors import PeerError
from utils.sync.flags import NO_FLAGS, Flags

# How the training thread waits for a sum that runs on another thread (a bucket's, the plain sum's,
# gloo's own, a round's): as long as it takes, unless this rank's group has broken.
# utils/elastic cuts every connection of a broken group. gloo then fails the receives still waiting
# for data, but not one whose data was arriving at that moment: that one waits out the whole
# --timeout (how often: docs/stopping-and-resuming.md). So a sum still running
# ABANDON_SECONDS after the group broke is given up. Its thread is left to the timeout; the group it
# waits on is not used again.
#
# Every wait for a sum is also counted per thread (waited_since, seconds_waited): waiting for a slower
# rank is nobody's work, so --balance leaves it out of a rank's own time (utils/balance/shares.py).
ABANDON_SECONDS = 2.0  # how long a sum may go on after this rank's group broke
LOOK_SECONDS = 0.1  # how often a wait looks whether the group broke (a sum that ends is seen at once)
_this_thread = threading.local()  # .seconds: what the thread has waited for sums so far


def waited_since(started):
    """The seconds since `started` (a time.perf_counter()), a wait for a sum: added to the calling
    thread's total (seconds_waited), and returned."""
    seconds = time.perf_counter() - started
    _this_thread.seconds = seconds_waited() + seconds
    return seconds


def seconds_waited():
    """The seconds the calling thread has waited for sums so far."""
    return getattr(_this_thread, "seconds", 0.0)


def wait_for(done, broken):
    """Block until the Event `done` is set. broken: the membership's Event of a broken group, or
    None (a group that cannot break: wait however long). Raises PeerError once the group has been
    broken for ABANDON_SECONDS and `done` is still not set."""
    broken_at = None
    while not done.wait(None if broken is None else LOOK_SECONDS):
        if broken.is_set():
            broken_at = broken_at or time.monotonic()
            if time.monotonic() - broken_at > ABANDON_SECONDS:
                raise PeerError(f"the sum did not end within {ABANDON_SECONDS:g} s of the cut")


class GradientSync(abc.ABC):
    """What the training loop calls between loss.backward() and the next forward.

    optimizer, scheduler: the step's (base_optimizer: Adam; the loop steps it through a
    DistributedOptimizer); compressor: what the sums carry (utils/comm/compress.py); timeline:
    where the sync draws its spans (utils/timeline.py)."""

    overlaps = False  # whether its sums run during backward (--overlap)

    def __init__(self, optimizer, scheduler, compressor, timeline):
        self.base_optimizer, self.scheduler, self.compressor = optimizer, scheduler, compressor
        self.timeline = timeline
        self.weight = 1.0  # this step's gradient weight (utils/sync/buckets.py's flat_buffer)
        self.own = NO_FLAGS  # this rank's flags for this step's sum, from begin()
        self.flag_sums = []  # the flags' values summed over ranks, as of the last sum that carried them
        self.busy_seconds = 0.0  # communication ran this long
        self.waited_seconds = 0.0  # the training thread waited this long for it

    @property
    @abc.abstractmethod
    def has_rank_state(self) -> bool:
        """Whether each rank's state_dict() differs (compression error feedback, --sync-every's
        own optimizer): then a checkpoint holds every rank's."""

    def seconds_waited(self) -> float:
        """How long the training thread has waited for communication so far."""
        return self.waited_seconds

    def begin(self, weight: float = 1.0, flags: Flags = None) -> None:
        """A step begins: this rank's gradient weighs `weight` (its share of the step's images times
        N), and `flags` (this rank's Flags) ride with the step's sum. The sum's threads read only
        what is handed here."""
        self.weight, self.own = weight, flags or NO_FLAGS

    def not_finite(self) -> None:
        """This step's loss was NaN or inf (said after the forward, before backward starts any sum):
        the flag that stops every rank after this step rides with its sum (utils/sync/flags.py)."""
        self.own = dataclasses.replace(self.own, not_finite=True)

    @property
    def own_flags(self) -> list[float]:
        """The values this rank's flags add to the step's sum (Flags.values)."""
        return self.own.values()

    @abc.abstractmethod
    def sum(self) -> None:
        """After loss.backward(): the gradients become their average over all ranks (or, for the
        kinds that overlap, will be by the time they are used)."""

    def step(self) -> None:
        """The step the loop's optimizer.step() takes: Adam's, the learning rate's schedule, and the
        gradients dropped (lazy and --sync-every change what it does)."""
        with self.timeline.span("optimizer"):
            self.base_optimizer.step()
            self.scheduler.step()
            self.base_optimizer.zero_grad()

    def flags(self) -> Flags:
        """The flags summed with the last sum that carried them: the same on every rank."""
        return Flags.from_sums(self.flag_sums)

    def finish(self) -> None:
        """Apply any update still due (before evaluating or saving)."""
        return None

    def flush(self) -> None:
        """The end of training: nothing left to apply, the same parameters on every rank."""
        self.finish()

    @abc.abstractmethod
    def stats(self) -> dict:
        """{busy_seconds, waited_seconds, bytes_sent, bytes_summed} since the start."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """This rank's own state, for the checkpoint."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None: ...

    def load_states(self, states: list, rank: int, world_size: int) -> None:
        """Continue from every old rank's state_dict() (a checkpoint's, or the members'): on as many
        ranks, this rank's own; on another number, what utils.comm.compress.state_for makes of them."""
        from utils.comm.compress import state_for  # (here: --status imports this module, never torch)

        self.load_state_dict(state_for(states, rank, world_size))

    def note(self) -> str | None:
        """What rank 0 says about this sum at start-up, if anything."""
        return None

    def close(self) -> None:
        """Stop its threads and hooks (the sync is being replaced, or training is over)."""
        return None

    @abc.abstractmethod
    def abandon(self) -> bool:
        """After a lost peer: close, and say whether the last step train_step returned from was
        left undone (its update was still being applied; what of it was applied is taken back)."""


class DistributedOptimizer:
    """The optimizer as the training loop sees it, after the ring sum: optimizer.step() takes the
    step the sum's kind calls for (GradientSync.step), the way Horovod's DistributedOptimizer and
    torch's PostLocalSGDOptimizer wrap an optimizer. The plain kinds: Adam's step and the schedule
    now; lazy (--lazy-update): each bucket's, as the next forward needs it; --sync-every: the
    inner step, and at a round's end the outer one. settle(): every update due applied (before
    evaluating or saving); flush(): the end of training."""

    def __init__(self, sync: GradientSync):
        self.sync = sync
        self.param_groups = sync.base_optimizer.param_groups

    def step(self) -> None:
        self.sync.step()

    def settle(self) -> None:
        self.sync.finish()

    def flush(self) -> None:
        self.sync.flush()
