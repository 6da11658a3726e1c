"""--restart on-failure: the process on a server that keeps its rank's training alive.

    keep(argv, prog, label, limit, say, handoff)   run train.py's training as a child; start it again when it fails
    after_child(code, said, stopped, backoff)      DONE, GIVE_UP or RESTART (and its delay) after a child (pure)

A server's training process can end without the job ending: it crashed (kill -9, out of memory),
it was cut off and its side had no majority, or it was frozen and the job went on without it.
The keeper starts the same command again, and that command joins the running job by itself
(utils/elastic/rejoin.py), or resumes the job if it stopped as a whole. What is not a failure
ends the keeper too: a finished run (0), bad input or a refusal (2: it would fail the same way
every time), a stop on a signal (3), a loss or parameters turned non-finite (4: a restart would
resume from the last good checkpoint and most likely meet the same NaN), a signal to the keeper
itself (passed on to the child), a child that waited --rejoin-timeout for its job in vain (the job
is over, or the network still out).

Restarts back off (Backoff): 1 s, 2 s, 4 s ... up to a minute, back to 1 s after a child that
trained (it says so through a pipe after its first step: trained()); after `limit` failures in a
row the keeper gives up with one line. A storm is a server failing before it trains again; a
server that trains between faults comes back each time after a second. It loads no torch: a
restart costs the child's start only. The child is in the keeper's process group: a kill
of the group (Ctrl-C, systemd's stop) reaches both; a kill -9 of the keeper alone leaves the training
running, as it would be without a keeper. Under torchrun and Slurm their own restarts
(--max-restarts, --requeue) keep precedence: utils/setup/config.py refuses --restart there.
"""

import os
import signal
import subprocess
import sys
import time

from utils.errors import EXIT_BAD_INPUT, EXIT_LOST_PEER, EXIT_NOT_FINITE, EXIT_STOPPED
from utils.setup import stop
from utils.setup.handoff import Handoff
from utils.setup.lifecycle import State

FIRST_DELAY, MAX_DELAY = 1.0, 60.0
FINAL = (0, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_NOT_FINITE)  # what ends the keeper: done, bad input, stopped, NaN
TRAINED_WORD, FINAL_WORD = b"t", b"f"  # what a child tells its keeper: it trains; it waited for its job in vain


class Backoff:
    """When to start again after a failure: exponential from `first` to `most` seconds; `limit`
    failures in a row (a child that trained ends the row) and it gives up."""

    def __init__(self, limit, first=FIRST_DELAY, most=MAX_DELAY):
        self.limit, self.first, self.most = limit, first, most
        self.in_a_row = 0

    def failed(self, trained):
        """A child failed, having trained a step or not: the delay before the next start, or None to give up."""
        self.in_a_row = 1 if trained else self.in_a_row + 1
        if self.in_a_row > self.limit:
            return None
        return min(self.most, self.first * 2 ** (self.in_a_row - 1))


def describe(code):
    """An exit code as the line says it."""
    if code < 0:
        return f"killed by {signal.Signals(-code).name}" if -code in signal.Signals._value2member_map_ else "killed"
    return {EXIT_LOST_PEER: "lost the job (exit 1)"}.get(code, f"exit {code}")


def keep(argv, prog, label, limit, say, handoff):
    """Run `prog argv` as a child until it ends in a way that is not a failure; returns the exit code
    to leave with. label: "train.py: rank 1"; say(line): one line to stderr; handoff: this process's
    (utils/setup/handoff.py), which each child gets with its keeper's pipe, restarts and time out."""
    backoff, passed, unsent, child = Backoff(limit), [], [], []

    def pass_on(signum, _frame):  # a stop for the job: the child stops after its step; no restart after it
        passed.append(signum)
        if child and child[0].poll() is None:
            child[0].send_signal(signum)
        else:  # (none running: the first child gets it as it starts; after a child, none starts again)
            unsent.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, pass_on)
    for signum in stop.take_early():  # a SIGUSR1 that came before these handlers
        pass_on(signum, None)
    while True:
        code, said = run_child(prog, argv, handoff, child, unsent)
        state, delay = after_child(code, said, bool(passed), backoff)
        if state == State.DONE:
            return code if code >= 0 else 128 - code
        if state == State.GIVE_UP:
            say(f"{label}: gave up after {limit} restarts in a row, none of them training a step "
                f"(last: {describe(code)}); the job goes on without this server")  # fmt: skip
            return EXIT_LOST_PEER
        handoff = handoff.replace(restarts=handoff.restarts + 1, out_since=time.time())
        say(f"{label}: training {describe(code)}; starting it again in {delay:g} s (restart {handoff.restarts})")
        waited = time.monotonic() + delay
        while time.monotonic() < waited and not passed:
            time.sleep(0.1)
        if passed:  # stopped while nothing was running: nothing to save
            return 128 + passed[0]


def after_child(code, said, stopped, backoff):
    """(State, delay): what the keeper does after a child ended with `code`, having written `said`
    into its pipe; stopped: a stop signal came meanwhile. DONE (what is not a failure), GIVE_UP
    (too many failures in a row), or RESTART after `delay` seconds."""
    if code in FINAL or stopped or FINAL_WORD in said:
        return State.DONE, None
    delay = backoff.failed(TRAINED_WORD in said)
    return (State.GIVE_UP, None) if delay is None else (State.RESTART, delay)


def run_child(prog, argv, handoff, child, unsent):
    """Start `prog argv` with the pipe to this keeper in its handoff (child: [the process], for the
    signal handler; unsent: signals that came before it, passed on to it and cleared) and wait for
    it: (its exit code, what it wrote into the pipe).

    The child starts with SIGUSR1 blocked, as this process has it around the start: passed on while
    the child still imports, before it can note one (stop.note_early unblocks it), it would end the
    child, where the stop it asks for comes after a step."""
    heard, told = os.pipe()
    env = handoff.replace(keeper_pipe=told).environ(os.environ)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    try:
        child[:] = [subprocess.Popen([sys.executable, "-u", prog, *argv], env=env, pass_fds=(told,))]
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.close(told)
    for signum in unsent[:1]:
        child[0].send_signal(signum)
    unsent.clear()
    code = child[0].wait()  # (a signal meanwhile is passed on, and the wait goes on)
    os.set_blocking(heard, False)
    try:
        said = os.read(heard, 16)
    except BlockingIOError:  # (nothing written, and the write end still open somewhere)
        said = b""
    os.close(heard)
    return code, said


def trained(handoff=None):
    """In a keeper's child, after each step: the first call tells the keeper this process trains.
    handoff: this process's (None: read it once)."""
    global _told
    if not _told:
        _told = True
        tell(TRAINED_WORD, handoff)


def final(handoff=None):
    """In a keeper's child that waited for its job in vain: the keeper must not start it again."""
    tell(FINAL_WORD, handoff)


def tell(word, handoff):
    pipe = (Handoff.from_environ() if handoff is None else handoff).keeper_pipe
    if pipe is None:
        return
    try:  # (the pipe stays open: its number must not name another file, here or after a rejoin's exec)
        os.write(pipe, word)
    except OSError:
        pass


_told = False
