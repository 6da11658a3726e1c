"""The ways this program stops early, each reported as one line, and the exit codes that tell them apart.

0  done                       1  lost a peer (PeerError)      2  bad input (UsageError; Damaged)
3  stopped on a signal, checkpoint saved (Stopped): resume with --resume
4  the loss or the parameters turned non-finite (NotFinite): nothing saved after it; --resume goes on
   from the last good checkpoint
128+signal (130, 143)  stopped at once: a second signal, or a signal before training began
"""

import enum
import re

EXIT_LOST_PEER, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_NOT_FINITE = 1, 2, 3, 4

# gloo appends advice to its socket errors ("Connection closed by peer [10.0.0.2]:41553. This is
# typically caused by a remote worker crashing. Check the logs ... GLHF! 🏖️"); the first clause says it all
GLOO_ADVICE = re.compile(r"\.?\s*(This is typically caused by|Check the logs of the remote worker|GLHF!).*", re.S)
GLOO_ENFORCE = re.compile(r"^[^.]*\. \d+ vs \d+\. ")  # "state_ >= CONNECTED. 1 vs 4. Pair is not connected ..."


class UsageError(Exception):
    """Bad input from the user: an argument, a file, the data. Exit code 2."""


class Damaged(UsageError):
    """A file read back does not match its digest (utils/store/checkpoint.py): nothing is loaded or
    overwritten, whatever else the run would do with an unreadable file (start afresh). Exit code 2."""


class Outcome(enum.Enum):
    """What a PeerError means for this rank, and so what train.py does after it."""

    LOST = "lost"  # a peer was lost while training: the checkpoint resumes the job (--resume)
    NOTHING_TO_RESUME = "nothing to resume"  # before training began, or while the state went round
    LEFT_BEHIND = "left behind"  # the job went on without this rank, or its side had no majority: it may rejoin
    FENCED = "fenced"  # told the job went on without it: it writes nothing, and may rejoin
    GAVE_UP = "gave up"  # it waited --rejoin-timeout for its job in vain: --restart must not start it again


class PeerError(Exception):
    """The job broke off: a peer died, fell silent or never came. Exit code 1.

    outcome: an Outcome; doing: what the rank was doing, for the loop's "lost a peer while ...";
    position: where a recovery left this rank, (epoch, step, stats), if it moved it."""

    def __init__(self, message, outcome=Outcome.LOST, doing="summing gradients", position=None):
        super().__init__(message)
        self.outcome, self.doing, self.position = outcome, doing, position

    @property
    def resumable(self):
        """Whether --resume continues the job from its checkpoint (not before training began)."""
        return self.outcome in (Outcome.LOST, Outcome.LEFT_BEHIND)

    @property
    def left_behind(self):
        """Whether the job may still run without this rank: its server may wait for it and rejoin."""
        return self.outcome in (Outcome.LEFT_BEHIND, Outcome.FENCED)

    @property
    def final(self):
        """Whether a keeper (--restart) must not start this server again."""
        return self.outcome == Outcome.GAVE_UP

    def where(self, place):
        """The same error, its message saying where this rank was ("(epoch 2, step 7)", "after epoch 2"),
        its outcome kept."""
        return PeerError(f"lost a peer while {self.doing} {place}: {self}", self.outcome, self.doing, self.position)


class Stopped(Exception):
    """A signal asked the job to stop (utils/setup/stop.py); every rank stopped after the same step and the
    checkpoint is saved. Exit code 3."""


class NotFinite(Exception):
    """The loss or the parameters turned non-finite (NaN or inf); every rank stopped at the same step
    and nothing was saved after it: the model file and the checkpoint are the last good ones. Exit code 4."""


def first_line(error):
    """The gist of an exception: its first useful clause, without gloo's [source.cc:123] prefix or advice."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())
    text = GLOO_ENFORCE.sub("", GLOO_ADVICE.sub("", text))
    return text.splitlines()[0][:300] if text else type(error).__name__
