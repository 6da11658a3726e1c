"""How a run of train.py ends: one line to stderr and an exit code, whatever mode it ran.

    Ending(argv, prog, script)     what the line needs: the command, the handoff, the rank, the job
    ending.lost(error)             a PeerError: start afresh and wait for the job (no return), or exit 1
    ending.stopped(error)          a signal stopped the job after a step, saved: exit 3
    ending.not_finite(error)       a NaN or an inf stopped the job, nothing saved after it: exit 4
    resume_command(argv, handoff)  the command that continues the job from its checkpoint
    say(line)                      one line to stderr in one write

train.py's main() dispatches the modes and catches what ends them; the words and codes are here.
"""

import os
import shlex
import sys

from utils.errors import EXIT_LOST_PEER, EXIT_NOT_FINITE, EXIT_STOPPED
from utils.setup import keeper, stop
from utils.setup.handoff import Handoff
from utils.setup.lifecycle import State
from utils.store.outputs import release


class Ending:
    """A run of `prog` (train.py, the file `script`) with `argv`: what it knows so far, set as it goes
    (handoff, config, supervisor, rank: "?" until known), for the line it ends with."""

    def __init__(self, argv, prog, script):
        self.argv, self.prog, self.script = argv, prog, script
        self.handoff, self.config, self.supervisor, self.rank = Handoff(), None, None, "?"

    def lost(self, e):
        """This rank lost its job: it starts afresh and waits for it (no return), or says so; exit 1."""
        ended = self.supervisor.after(e, stop.signalled()) if self.supervisor else State.LOST
        if ended == State.AGAIN:
            timeout = self.config.job.rejoin_timeout
            say(f"{self.prog}: rank {self.rank}: {e}; waiting up to {timeout:g} s to join the job again")
            release()
            self.supervisor.start_again(self.script, self.argv)  # (this process, started afresh: no return)
        hint = f"; to resume: {resume_command(self.argv, self.handoff, self.prog)}" if e.resumable else ""
        say(f"{self.prog}: rank {self.rank}: {e}{hint}")
        if e.final:
            keeper.final(self.handoff)
        return EXIT_LOST_PEER

    def stopped(self, e):
        """A signal stopped the job after a step, saved; exit 3 (Slurm's warning: the job requeued)."""
        stop.leaving()  # a requeue's SIGTERM, or a late repeat, must not make this exit a crash
        say(f"{self.prog}: rank {self.rank}: {e}; to resume: {resume_command(self.argv, self.handoff, self.prog)}")
        job = self.config.job
        if job.slurm and job.rank == 0 and stop.signalled() == "SIGUSR1":  # Slurm's warning: its time is nearly up
            from utils.setup.slurm import requeue

            say(f"{self.prog}: rank 0: {requeue(job.slurm, self.config.outputs.checkpoint)}")
        return EXIT_STOPPED

    def not_finite(self, e):
        """The loss or the parameters turned non-finite: every rank stopped at the same step, and the
        files are the last good ones (nothing was saved after it); exit 4, which no keeper restarts."""
        stop.leaving()
        outputs = self.config.outputs
        say(
            f"{self.prog}: rank {self.rank}: {e}; nothing was saved after it: {outputs.save_path} and "
            f"{outputs.checkpoint} are kept as they were (the last good ones, if any); to go on from that "
            f"checkpoint: {resume_command(self.argv, self.handoff, self.prog)}"
        )
        return EXIT_NOT_FINITE


def resume_command(argv, handoff, prog="train.py"):
    """The command that continues this job from its checkpoint (the local launcher's, for its ranks)."""
    if handoff.resume_command:
        return handoff.resume_command
    return shlex.join(["python3", "-u", prog, *argv, *([] if "--resume" in argv else ["--resume"])])


def say(line):
    """One line to stderr in one write: ranks under torchrun or our launcher share one pipe, and
    print's two writes (text, then newline) let their lines run into each other."""
    sys.stderr.flush()
    os.write(2, (line + "\n").encode())
