"""Going on without a lost rank: the trainer's side of utils/elastic/membership.py.

    recovery = Recovery(membership, trainer)        trainer: the run's utils.learn.training.Trainer
    sync, (epoch, step, stats) = recovery.go_on(error, old_sync, (epoch, step, stats))

When a step fails (a peer died, fell silent or was cut off), utils/run.py abandons the step in
flight and hands over here, with the last step this rank completed. Then:

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
from utils.elastic import faults
from utils.elastic.membership import Fenced, NoQuorum
from utils.errors import Outcome, PeerError, UsageError, first_line
from utils.exchange import all_gather_state, broadcast_state
from utils.observe.report import EpochStats
from utils.store import checkpoint, outputs
from utils.store.files import check_writable

MAX_ATTEMPTS = 3  # new groups that did not form before the survivors give up


class Done:
    """The last two steps this rank completed, (epoch, step, a copy of the epoch's stats then):
    where a job that lost a rank goes on from (Recovery.go_on)."""

    def __init__(self, epoch, step, stats, first=None):
        self.last = self.before = (epoch, step, dataclasses.replace(stats))
        self.first = first  # called once, after the first step (after a change of members: its time)

    def add(self, epoch, step, stats):
        self.before, self.last = self.last, (epoch, step, dataclasses.replace(stats))
        if self.first is not None:
            self.first, first = None, self.first
            first(epoch, step)


class Recovery:
    def __init__(self, membership, trainer):
        self.membership, self.config, self.timeline = membership, trainer.config, trainer.timeline
        self.model, self.optimizer, self.scheduler = trainer.model, trainer.optimizer, trainer.scheduler
        self.state = trainer.state  # state(epoch, step, stats, compression) -> the checkpoint dict
        self.make_sync = trainer.new_sync  # (hosts) -> a gradient sync over the default group (utils/sync/)
        self.writes = membership.me == 0  # this process holds the output locks (rank 0 took them)
        self.abandoned = []  # the gradient syncs of broken groups, dropped on a timer's thread: see go_on
        self.steps_per_epoch = trainer.steps_per_epoch
        self.out = {}  # a lost member's control address -> (when, the job's step count then): its heal line

    def go_on(self, error, old_sync, position):
        """After `error` (a PeerError): the new gradient sync and the position to go on from."""
        epoch, step, stats = position
        membership, started = self.membership, time.monotonic()
        before = list(membership.members)
        reason = membership.reason if membership.lost is not None else short_reason(error)
        tried = []
        while True:
            try:
                decision = membership.agree([epoch, step], tried)
            except Fenced as e:
                raise PeerError(str(e), Outcome.FENCED) from None
            except NoQuorum as e:
                message = f"{first_line(error)}; {e}{self.save_last_step(position, e.alive, old_sync)}"
                raise PeerError(message, Outcome.LEFT_BEHIND) from None
            if not self.config.job.recover:
                survivors = decision.members
                raise PeerError(
                    f"{first_line(error)} (--no-recover){self.save_last_step(position, survivors, old_sync)}"
                ) from None
            try:
                membership.join(decision, timeout=membership.heartbeat + 5, gloo_timeout=self.config.sync.timeout)
                break
            except (RuntimeError, ValueError) as e:  # a member did not come: agree again without it
                tried.append(decision.name)
                if len(tried) >= MAX_ATTEMPTS:
                    raise PeerError(
                        f"{first_line(error)}; the survivors could not form a new group {len(tried)} times "
                        f"({first_line(e)}){self.save_last_step(position, [membership.me], old_sync)}"
                    ) from None
                say(f"rank {membership.me}: generation {decision.g} did not form ({first_line(e)}); agreeing again")
        lost = [m for m in before if m not in membership.members]
        for m in lost:
            self.out[tuple(membership.book[m]["address"][:1])] = (time.monotonic(), self.steps_done(epoch, step))
        try:
            sync, (epoch_now, step_now, stats) = self.form(decision, old_sync, position)
        except PeerError as e:  # another rank lost while the state went round: again, from where this rank is
            return self.go_on(e, old_sync, e.position or position)
        # gloo's own sum (--allreduce gloo) may still wait on the lost peer in its group's threads, and
        # the group's destructor joins them: dropping the old sync here would wait out --timeout on
        # this thread (measured: a pulled cable, 56 s). A timer drops it once that wait has timed out.
        self.abandoned.append(old_sync)
        drop = threading.Timer(self.config.sync.timeout + 5, self.abandoned.remove, (old_sync,))
        drop.daemon = True
        drop.start()
        seconds = time.monotonic() - started
        say(
            f"rank {membership.me}: lost rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} "
            f"at epoch {epoch}, step {step + 1} ({reason}); continuing on {plural(dist.get_world_size(), 'rank')} "
            f"from step {step_now} (members {', '.join(map(str, membership.members))}, {seconds:.2f} s"
            f"{'; ' + sync.compressor.lost_rank_note if sync.compressor.lost_rank_note else ''})"
        )
        self.mark("lost", lost)
        return sync, (epoch_now, step_now, stats)

    def grow(self, old_sync, position):
        """At a step boundary whose sum said a server waits to join: take it in. Returns the new
        sync and the position (unchanged); a failure on the way is a lost peer (go_on)."""
        membership, started = self.membership, time.monotonic()
        before, decision = list(membership.members), None
        try:
            decision = membership.grow(list(position[:2]), timeout=membership.heartbeat + 5)
            faults.point("join")
            membership.join(decision, timeout=membership.heartbeat + 5, gloo_timeout=self.config.sync.timeout)
        except (RuntimeError, ValueError) as e:  # (a joiner that died meanwhile asks no more: forget it)
            membership.forget_joiners(decision)
            return self.go_on(PeerError(f"a server failed to join: {first_line(e)}"), old_sync, position)
        old_sync.close()
        try:
            sync, position = self.form(decision, old_sync, position)
        except PeerError as e:
            return self.go_on(e, old_sync, e.position or position)
        joined = [m for m in membership.members if m not in before]
        say(
            f"rank {membership.me}: rank{'s' if len(joined) > 1 else ''} {', '.join(map(str, joined))} joined after "
            f"epoch {position[0]}, step {position[1]}; continuing on {plural(dist.get_world_size(), 'rank')} "
            f"(members {', '.join(map(str, membership.members))}, {time.monotonic() - started:.2f} s)"
            + "".join(self.healed(m, position) for m in joined)
        )
        self.mark("joined", joined)
        return sync, position

    def steps_done(self, epoch, step):
        return (epoch - 1) * self.steps_per_epoch + step

    def healed(self, member, position):
        """'; rank 3 was out 12.3 s, 40 steps' when `member` came from the server of a member lost
        before (the same control address), else ''."""
        left = self.out.pop(tuple(self.membership.book[member]["address"][:1]), None)
        if left is None:
            return ""
        seconds, steps = time.monotonic() - left[0], self.steps_done(*position[:2]) - left[1]
        return f"; rank {member} comes back after {seconds:.1f} s out, {plural(steps, 'step')} missed"

    def form(self, decision, old_sync, position):
        """In the decided generation's group (joined already): the source's state to every member
        (a joining server: position None, old_sync None), a new gradient sync over the new group.
        Returns (sync, (epoch, step, stats))."""
        source = self.membership.rank_of(decision.source)
        furthest = tuple(decision.position)
        try:
            state = broadcast_state(self.state(*position) if dist.get_rank() == source else None, src=source)
        except RuntimeError as e:
            raise PeerError(
                f"lost a peer while the state went round: {first_line(e)}", Outcome.NOTHING_TO_RESUME
            ) from None
        if dist.get_rank() != source:
            self.model.load_state_dict(state["model"])
        for p in self.model.parameters():  # an abandoned step's gradients must not add to the next one's
            p.grad = None
        checkpoint.restore(state, self.optimizer, self.scheduler, None, 0, 1)  # (no compression state in it)
        at = (state["epoch"], state["step"], EpochStats(**state["epoch_stats"]))  # where this rank is now
        try:
            return self._new_sync(state, at, old_sync, position, source, furthest)
        except RuntimeError as e:
            message = f"lost a peer while forming the new group: {first_line(e)}"
            raise PeerError(message, Outcome.NOTHING_TO_RESUME, position=at) from None

    def _new_sync(self, state, at, old_sync, position, source, furthest):
        sync = self.make_sync(hierarchical.discover(self.config.job.host_id))  # the new group's servers
        if sync.compressor.compresses:  # the error buffers of those at the furthest step, the source's first
            mine = old_sync.state_dict() if old_sync is not None else None
            everyone = all_gather_state((position is not None and tuple(position[:2]) == furthest, mine))
            states = [everyone[source][1]] + [s for r, (at, s) in enumerate(everyone) if at and r != source]
            sync.load_states(states, dist.get_rank(), dist.get_world_size())
        if dist.get_rank() == 0:
            self.take_outputs()
        return sync, at

    def mark(self, what, ranks):
        now = self.timeline.now_ns()
        self.timeline.add("membership", now, now, **{what: ranks, "members": list(self.membership.members)})

    def save_last_step(self, position, survivors, old_sync):
        """The lowest survivor writes its last completed step; the text that says where."""
        epoch, step, stats = position
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
        checkpoint.save(self.state(epoch, step, stats, everyone, len(self.membership.members)), path)
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
        return (saved["epoch"], saved["step"]) > tuple(position[:2])
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
