"""One server's training process from its start to its end: the states it goes through and who decides.

    supervisor = Supervisor(config, handoff, instruments)    train.py's rank, once its command is parsed
    supervisor.run(rank)              through the states below until this process trained, or raise
    supervisor.after(error, signal)   a PeerError ended it: AGAIN (start afresh and wait), GIVE_UP or LOST
    supervisor.start_again(script, argv)   AGAIN: this process starts afresh as the same command

    rank.start(rendezvous_seconds)    what run() asks of train.py: start (or resume) the job with every
    rank.join()                       rank, True when it formed and trained; join the running job

    transition(state, succeeded, out_of_time)   the rules between states (pure, unit-tested)

    START ─────────────────────────────────────────────────▶ DONE
    LOOK ──a member answered──▶ JOIN ──────────────────────▶ DONE
      └───no one answered──▶ START
    WAIT ──a member answered──▶ JOIN
      └──no answer──▶ OFFER ──every rank came, the job ran──▶ DONE
           ▲            └──not every rank came──▶ WAIT        (WAIT, OFFER: past the deadline ─▶ GIVE_UP)
           └────────────┘
    a PeerError: left behind ──▶ AGAIN (this process, started afresh, begins in WAIT); waited in vain ──▶ GIVE_UP

A process begins in JOIN (--join), LOOK (a server's own command: utils/elastic/rejoin.py's per_server),
WAIT (it started itself again after it lost the job: its handoff's rejoin_until) or START (a rank of
the local launcher, torchrun or Slurm, who start their ranks again themselves). START starts the job
with every rank, or resumes it: rank 0 decides from its checkpoint (rejoin.choose). OFFER is a start
that gives up after RENDEZVOUS_SECONDS when not every rank comes (a side without the majority never
trains alone). The keeper (utils/setup/keeper.py) restarts a process that ended LOST: its decision
after each child (keeper.after_child) is a State too, RESTART, DONE or GIVE_UP.
"""

import enum
import os
import sys
import time

from utils.elastic import rejoin
from utils.errors import Outcome, PeerError

RENDEZVOUS_SECONDS = 5.0  # a waiting server's offer of a whole restart, between two asks of the members


class State(enum.Enum):
    START = "start"  # start the job with every rank, or resume it (rank 0 decides from its checkpoint)
    LOOK = "look"  # a server's own command: ask its job's members once before it starts
    WAIT = "wait"  # lost the job: ask its members, offer a whole restart, until --rejoin-timeout
    OFFER = "offer"  # a waiting server offers the rendezvous of a whole restart for RENDEZVOUS_SECONDS
    JOIN = "join"  # a member answered (or --join): join the running job at its next step
    AGAIN = "again"  # left behind: this process starts afresh as the same command, in WAIT
    RESTART = "restart"  # (the keeper) the child failed: start it again after a delay
    DONE = "done"  # this process trained, or its job was finished
    LOST = "lost"  # it lost the job and leaves (exit 1); a keeper may start it again
    GIVE_UP = "give up"  # it waited for its job in vain, or its keeper's restarts failed too often


ENDS = (State.DONE, State.LOST, State.GIVE_UP, State.AGAIN)


def transition(state, succeeded, out_of_time=False):
    """The state after `state` did its part. succeeded: LOOK, WAIT: a member answered; START, OFFER:
    the start formed and trained; JOIN: taken in. out_of_time: the wait's deadline has passed."""
    if state in (State.START, State.JOIN):
        return State.DONE
    if state == State.LOOK:
        return State.JOIN if succeeded else State.START
    if state == State.WAIT:
        return State.JOIN if succeeded else State.GIVE_UP if out_of_time else State.OFFER
    if state == State.OFFER:
        return State.DONE if succeeded else State.GIVE_UP if out_of_time else State.WAIT
    raise ValueError(f"{state} is an end")


def first_state(job, handoff, per_server):
    """Where a process begins: see the module's docstring."""
    if job.join is not None:
        return State.JOIN
    if not per_server:
        return State.START
    return State.WAIT if handoff.rejoin_until else State.LOOK


class Supervisor:
    """What one server's training process does next, from its handoff and what happened so far.
    instruments: fault injection at a restart, the event log of a wait's asks and offers; clock:
    time.time; ask_members(config, members): whether a member of the job answers (rejoin.job_answers)."""

    def __init__(self, config, handoff, instruments, clock=time.time, ask_members=rejoin.job_answers):
        self.config, self.handoff, self.instruments, self.clock = config, handoff, instruments, clock
        self.ask_members = ask_members
        self.per_server = rejoin.per_server(config.job, handoff)
        self.state = first_state(config.job, handoff, self.per_server)
        self.members = rejoin.known_members(config.outputs.checkpoint) if self.per_server else []

    def run(self, rank):
        """Go through the states until this process trained (DONE); PeerError when it waited in vain."""
        if self.handoff.restarts:  # a process its keeper started again
            self.instruments.at_restart(self.config.job.rank)
        while self.state not in ENDS:
            self.state = self.step(rank)
        if self.state == State.GIVE_UP:
            raise PeerError(
                f"waited {self.config.job.rejoin_timeout:g} s (--rejoin-timeout) for the job: no member answered, "
                "and not every rank came to start it again (the job is over, or this server is still cut off)",
                Outcome.GAVE_UP,
            )

    def step(self, rank):
        """Do this state's part; the next state."""
        state = self.state
        if state == State.LOOK:  # (a server that was in no job here, or whose job finished, asks nobody)
            succeeded = bool(self.members) and self.ask_members(self.config, self.members)
        elif state == State.WAIT:
            succeeded = self._logged("rejoin-ask", self.ask_members, self.config, self.members)
        elif state == State.OFFER:
            succeeded = self._logged("rejoin-offer", rank.start, RENDEZVOUS_SECONDS)
        elif state == State.START:
            succeeded = rank.start(None)
        else:
            succeeded = rank.join()
        out_of_time = self.handoff.rejoin_until is not None and self.clock() >= self.handoff.rejoin_until
        return transition(state, succeeded, out_of_time)

    def _logged(self, event, call, *args):
        """call(*args), its outcome and seconds in the event log (bench/heal/heal.py reads how a wait went)."""
        started = time.monotonic()
        outcome = call(*args)
        self.instruments.log(event=event, outcome=bool(outcome), seconds=round(time.monotonic() - started, 3))
        return outcome

    def after(self, error, signalled):
        """The state a PeerError leaves this process in: AGAIN (left behind, a server that takes itself
        back, no stop signal), GIVE_UP (it waited for its job in vain) or LOST."""
        job = self.config.job
        if error.left_behind and self.per_server and job.rejoin_timeout > 0 and signalled is None:
            return State.AGAIN
        return State.GIVE_UP if error.final else State.LOST

    def start_again(self, script, argv, environ=os.environ):
        """AGAIN: this process starts afresh as `script argv` (the same command; its stuck threads and
        broken group gone), waiting up to --rejoin-timeout for its job. Does not return."""
        now = self.clock()
        handoff = self.handoff.replace(
            rejoin_until=now + self.config.job.rejoin_timeout, out_since=now, rejoins=self.handoff.rejoins + 1
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-u", os.path.abspath(script), *argv], handoff.environ(environ))
