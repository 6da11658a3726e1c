"""Elastic training: the epoch loop inside one retry wrapper (Horovod's run_fn), the trainer's side
of utils/elastic/membership.py.

Why this long: the wrapper, its two changes and what a rank writes when it cannot go on are one
procedure over one rank's view of the job; apart they would hand that view back and forth.

    elastic = Elastic(membership, trainer, instruments)   trainer: the run's utils.learn.training.Trainer
    elastic.join(decision)                                a joining server: the members' state, first
    elastic.run(train)                                    train() until it returns Ended.EPOCH

Two changes re-form the group, each a value (Lost, Grow), handled in one loop until training can
go on (a failure on the way is a new Lost, from where this rank is then):

    Grow   the step's flags said a server waits to join: every member takes it in at that step.
    Lost   a step failed (a peer died, fell silent or was cut off): the step in flight is abandoned
           and the survivors go on from the last step this rank completed:

    1. The survivors agree (membership.agree) who is left and the furthest step any of them
       completed. A rank that completed step k holds exactly the state every rank would have
       after k: the sum of step k had every rank's gradient in it, the dead one's included.
    2. With --recover (the default) and a quorum, they form a new process group on a store the
       leader hosts, the rank at the furthest step sends its whole training state to the others
       (the checkpoint dict of utils/store/checkpoint.py, in memory), and training goes on from there
       on the survivors, with the same global batch: each step's images are shared among fewer
       ranks, as a resume on fewer ranks does, so every image is still trained once. It is that
       resume, without the process restart: the oracle tests compare the two bit for bit.
    3. Otherwise (--no-recover, no quorum), the lowest surviving rank writes the checkpoint of its
       last completed step to its own --checkpoint and every survivor exits 1. A rank that was
       fenced out (the others went on without it) writes nothing.

PowerSGD's error buffers are each rank's own: a dead rank's is lost. The survivors go on from the
mean of the error buffers of those at the furthest step, as a resume on another number of ranks does.
"""

import dataclasses
import os
import sys
import threading
import time

import torch.distributed as dist

from utils.comm import hierarchical
from utils.elastic.membership import Fenced, NoQuorum
from utils.errors import Outcome, PeerError, UsageError, first_line
from utils.exchange import all_gather_state, broadcast_state
from utils.learn.callbacks import Callback
from utils.observe.instruments import OFF
from utils.observe.report import say_joined
from utils.run import Ended
from utils.store import checkpoint, outputs
from utils.store.files import check_writable

MAX_ATTEMPTS = 3  # new groups that did not form before the survivors give up


@dataclasses.dataclass(frozen=True)
class Lost:
    """A peer was lost: go on from `position` (a utils.learn.state.Position) after `error`."""

    error: PeerError
    position: object


@dataclasses.dataclass(frozen=True)
class Grow:
    """A server waits to join: take it in at `position`."""

    position: object


class NotElastic:
    """Without a membership (one rank, or --no-recover's start): a lost peer ends the job."""

    def run(self, train):
        train()


class Elastic(Callback):
    """The retry wrapper (see the module's docstring); a concern of the loop too: this rank's join
    flag rides with each sum, and the first step after a change is noted for the benchmarks."""

    def __init__(self, membership, trainer, instruments=OFF):
        self.membership, self.trainer, self.state = membership, trainer, trainer.state
        self.config, self.timeline, self.instruments = trainer.config, trainer.timeline, instruments
        self.writes = membership.me == 0  # this process holds the output locks (rank 0 took them)
        self.abandoned = []  # the gradient syncs of broken groups, dropped on a timer's thread: see retire
        self.out = {}  # a lost member's control address -> (when, the job's step count then): its heal line
        self.changed = None  # the last change ("joined", "grew", "shrank"), until the first step after it

    # -- the loop's concern ---------------------------------------------------------------------
    def flags(self, flags):
        return dataclasses.replace(flags, joining=True) if self.membership.wants_growth() else flags

    def step_ends(self, state, step, flags):
        if self.changed is not None:
            after, self.changed = self.changed, None
            world_size = dist.get_world_size()
            self.instruments.log(
                event="first-step", after=after, epoch=state.position.epoch, step=step, world_size=world_size
            )

    # -- the wrapper ----------------------------------------------------------------------------
    def run(self, train):
        """train() (the epochs, utils.run.train_epochs) until it ends the run; a server waiting or a
        lost peer re-forms the group first, and train() goes on from the state's position."""
        while True:
            try:
                if train() == Ended.EPOCH:
                    return
                change = Grow(self.state.last)
            except PeerError as error:
                undone = self.trainer.sync.abandon()  # (lazy: the last step's update was left half done)
                change = Lost(error, self.state.before if undone else self.state.last)
            while change is not None:
                change = self.grow(change) if isinstance(change, Grow) else self.recover(change)

    def join(self, decision, note=""):
        """A joining server, taken in by `decision` (utils.elastic.join.join_running_job): the
        members' state, then a gradient sum over the new group. note: what its joined line adds."""
        self.form(decision, None, None)
        position = self.state.position
        say_joined(self.membership, position.epoch, position.step, note)
        self.changed = "joined"

    def recover(self, lost):
        """After a lost peer: agree with the survivors and re-form, or raise the PeerError that
        says why this rank cannot go on. Returns None, or the next Lost if another peer was lost."""
        membership, started, before = self.membership, time.monotonic(), list(self.membership.members)
        reason = membership.reason if membership.lost is not None else short_reason(lost.error)
        decision = self.agree(lost)
        position = lost.position
        gone = [m for m in before if m not in membership.members]
        for m in gone:
            self.out[tuple(membership.book[m]["address"][:1])] = (time.monotonic(), self.steps_done(position))
        try:
            self.form(decision, self.trainer.sync, position)
        except PeerError as e:  # another rank lost while the state went round: again, from where this rank is
            return Lost(e, e.position or position)
        seconds = time.monotonic() - started
        note = self.trainer.sync.compressor.lost_rank_note
        say(
            f"rank {membership.me}: lost rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} "
            f"at epoch {position.epoch}, step {position.step + 1} ({reason}); continuing on "
            f"{plural(dist.get_world_size(), 'rank')} from step {self.state.position.step} (members "
            f"{', '.join(map(str, membership.members))}, {seconds:.2f} s{'; ' + note if note else ''})"
        )
        self.mark("lost", gone)
        self.changed = "shrank"
        return None

    def agree(self, lost):
        """The survivors' decision and its group joined (utils/elastic/membership.py), or the
        PeerError of a rank that cannot go on: fenced, no majority, --no-recover, no group formed."""
        membership, tried, error, position = self.membership, [], lost.error, lost.position
        old_sync = self.trainer.sync
        while True:
            try:
                decision = membership.agree([position.epoch, position.step], tried)
            except Fenced as e:
                raise PeerError(str(e), Outcome.FENCED) from None
            except NoQuorum as e:
                message = f"{first_line(error)}; {e}{self.save_last_step(position, e.alive, old_sync)}"
                raise PeerError(message, Outcome.LEFT_BEHIND) from None
            if not self.config.job.recover:
                saved = self.save_last_step(position, decision.members, old_sync)
                raise PeerError(f"{first_line(error)} (--no-recover){saved}") from None
            try:
                membership.join(decision, timeout=membership.heartbeat + 5, gloo_timeout=self.config.sync.timeout)
                return decision
            except (RuntimeError, ValueError) as e:  # a member did not come: agree again without it
                tried.append(decision.name)
                if len(tried) >= MAX_ATTEMPTS:
                    saved = self.save_last_step(position, [membership.me], old_sync)
                    raise PeerError(
                        f"{first_line(error)}; the survivors could not form a new group {len(tried)} times "
                        f"({first_line(e)}){saved}"
                    ) from None
                say(f"rank {membership.me}: generation {decision.g} did not form ({first_line(e)}); agreeing again")

    def grow(self, grow):
        """At a step boundary whose sum said a server waits to join: take it in. Returns None, or a
        Lost if a peer was lost on the way."""
        membership, started, position = self.membership, time.monotonic(), grow.position
        before, decision = list(membership.members), None
        self.state.settle()
        try:
            decision = membership.grow([position.epoch, position.step], timeout=membership.heartbeat + 5)
            self.instruments.point("join")
            membership.join(decision, timeout=membership.heartbeat + 5, gloo_timeout=self.config.sync.timeout)
        except (RuntimeError, ValueError) as e:  # (a joiner that died meanwhile asks no more: forget it)
            membership.forget_joiners(decision)
            return Lost(PeerError(f"a server failed to join: {first_line(e)}"), position)
        self.trainer.sync.close()
        try:
            self.form(decision, self.trainer.sync, position)
        except PeerError as e:
            return Lost(e, e.position or position)
        joined = [m for m in membership.members if m not in before]
        say(
            f"rank {membership.me}: rank{'s' if len(joined) > 1 else ''} {', '.join(map(str, joined))} joined after "
            f"epoch {position.epoch}, step {position.step}; continuing on {plural(dist.get_world_size(), 'rank')} "
            f"(members {', '.join(map(str, membership.members))}, {time.monotonic() - started:.2f} s)"
            + "".join(self.healed(m, position) for m in joined)
        )
        self.mark("joined", joined)
        self.changed = "grew"
        return None

    def steps_done(self, position):
        return (position.epoch - 1) * self.trainer.steps_per_epoch + position.step

    def healed(self, member, position):
        """'; rank 3 comes back after 12.3 s out, 40 steps missed' when `member` came from the server
        of a member lost before (the same control address), else ''."""
        left = self.out.pop(tuple(self.membership.book[member]["address"][:1]), None)
        if left is None:
            return ""
        seconds, steps = time.monotonic() - left[0], self.steps_done(position) - left[1]
        return f"; rank {member} comes back after {seconds:.1f} s out, {plural(steps, 'step')} missed"

    def form(self, decision, old_sync, position):
        """In the decided generation's group (joined already): the source's state to every member
        (a joining server: position None, old_sync None), loaded into the training state; a new
        gradient sum over the new group. A PeerError (with where this rank is now) if a peer is lost."""
        source = self.membership.rank_of(decision.source)
        me_source = dist.get_rank() == source
        try:
            sent = self.state.state_dict(world_size=dist.get_world_size(), position=position) if me_source else None
            received = broadcast_state(sent, src=source)
        except RuntimeError as e:
            raise PeerError(
                f"lost a peer while the state went round: {first_line(e)}", Outcome.NOTHING_TO_RESUME
            ) from None
        self.trainer.restore(dict(received, compression=None), model=not me_source, shares=False)
        try:
            self.new_sync(old_sync, position, source, tuple(decision.position))
        except RuntimeError as e:
            message = f"lost a peer while forming the new group: {first_line(e)}"
            raise PeerError(message, Outcome.NOTHING_TO_RESUME, position=self.state.position.copy()) from None

    def new_sync(self, old_sync, position, source, furthest):
        """A gradient sum over the new group; a compressed one takes the error buffers of those at the
        furthest step, the source's first (a joining server has none)."""
        mine = old_sync.state_dict() if old_sync is not None and old_sync.compressor.compresses else None
        sync = self.trainer.new_sync(hierarchical.discover(self.config.job.host_id))  # the new group's servers
        if sync.compressor.compresses:
            at = position is not None and (position.epoch, position.step) == furthest
            everyone = all_gather_state((at, mine))
            states = [everyone[source][1]] + [s for r, (at, s) in enumerate(everyone) if at and r != source]
            sync.load_states(states, dist.get_rank(), dist.get_world_size())
        if old_sync is not None:
            self.retire(old_sync)
        if dist.get_rank() == 0:
            self.take_outputs()

    def retire(self, old_sync):
        """gloo's own sum (--allreduce gloo) may still wait on the lost peer in its group's threads, and
        the group's destructor joins them: dropping the old sync here would wait out --timeout on
        this thread. A timer drops it once that wait has timed out."""
        self.abandoned.append(old_sync)
        drop = threading.Timer(self.config.sync.timeout + 5, self.abandoned.remove, (old_sync,))
        drop.daemon = True
        drop.start()

    def mark(self, what, ranks):
        now = self.timeline.now_ns()
        self.timeline.add("membership", now, now, **{what: ranks, "members": list(self.membership.members)})

    def save_last_step(self, position, survivors, old_sync):
        """The lowest survivor writes its last completed step; the text that says where."""
        epoch, step = position.epoch, position.step
        writer = next(m for m in self.membership.members if m in survivors)  # the lowest rank
        where = f"epoch {epoch}, step {step}" if step else f"the start of epoch {epoch}"
        if writer != self.membership.me:
            return f"; rank {writer} saves the checkpoint of {where}"
        path = self.config.outputs.checkpoint
        if further_along(path, position):
            return f"; {path} is further along already (kept)"
        try:
            self.take_outputs()
        except Exception as e:  # another job holds it
            return f"; could not write the checkpoint ({first_line(e)})"
        # compressed: only this rank's own compression state; a resume treats it as a resize does
        everyone = [old_sync.state_dict()] if old_sync.compressor.compresses else None
        saved = self.state.state_dict(everyone, len(self.membership.members), position)
        if checkpoint.not_finite(saved) is not None:  # never over the last good checkpoint
            return f"; the parameters of {where} are not finite: nothing saved ({path} kept as it was)"
        checkpoint.save(saved, path)
        return f"; saved the checkpoint of {where} to {path}"

    def take_outputs(self):
        """This rank now writes the job's files: take their locks, from a lost member if need be."""
        if self.writes:
            return
        ours = {f"pid {entry['pid']} on {entry['host']}" for entry in self.membership.book.values()}
        for option, path in self.config.outputs.files():  # on this server they may not exist yet
            check_writable(path, option)
        outputs.lock_outputs(self.config.outputs, hold=True, take_from=ours)
        self.writes = True


def further_along(path, position):
    """Whether the checkpoint at `path` is past `position` (so that a late writer keeps it)."""
    try:
        saved = checkpoint.safe_load(path, "checkpoint")
        return (saved["epoch"], saved["step"]) > (position.epoch, position.step)
    except (UsageError, KeyError, TypeError):  # none, or not one of ours: nothing to keep
        return False


def plural(n, word):
    return f"{n} {word}{'s' if n != 1 else ''}"


def say(line):
    """One line to stdout in one write: every survivor says it, and they may share one pipe."""
    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


def short_reason(error):
    text = str(error).lower()
    for words, reason in (
        ("reset", "connection reset"),
        ("closed", "connection closed"),
        ("refused", "connection refused"),
        ("timed out", "timed out"),
    ):
        if words in text:
            return reason
    return first_line(error)
