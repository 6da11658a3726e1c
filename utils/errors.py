"""The ways this program stops early, each reported as one line, and the exit codes that tell them apart.

0  done                       1  lost a peer (PeerError)      2  bad input (UsageError)
3  stopped on a signal, checkpoint saved (Stopped): resume with --resume
128+signal (130, 143)  stopped at once: a second signal, or a signal before training began
"""

import re

EXIT_LOST_PEER, EXIT_BAD_INPUT, EXIT_STOPPED = 1, 2, 3

# gloo appends advice to its socket errors ("Connection closed by peer [10.0.0.2]:41553. This is
# typically caused by a remote worker crashing. Check the logs ... GLHF! 🏖️"); the first clause says it all
GLOO_ADVICE = re.compile(r"\.?\s*(This is typically caused by|Check the logs of the remote worker|GLHF!).*", re.S)
GLOO_ENFORCE = re.compile(r"^[^.]*\. \d+ vs \d+\. ")  # "state_ >= CONNECTED. 1 vs 4. Pair is not connected ..."


class UsageError(Exception):
    """Bad input from the user: an argument, a file, the data. Exit code 2."""


class PeerError(Exception):
    """The job broke off: a peer died, fell silent or never came. Exit code 1."""

    def __init__(self, message, resumable=True, doing="summing gradients"):
        super().__init__(message)
        self.resumable = resumable  # False before training started: there is nothing to resume
        self.doing = doing  # what the rank was doing, for the trainer's "lost a peer while ..."
        self.position = None  # where the rank is, if a recovery moved it (utils/elastic/recovery.py)
        self.left_behind = False  # the job went on without this rank, or its side had no majority: it may rejoin
        self.final = False  # it waited for the job in vain: --restart must not start it again


class Stopped(Exception):
    """A signal asked the job to stop (utils/setup/stop.py); every rank stopped after the same step and the
    checkpoint is saved. Exit code 3."""


def first_line(error):
    """The gist of an exception: its first useful clause, without gloo's [source.cc:123] prefix or advice."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())
    text = GLOO_ENFORCE.sub("", GLOO_ADVICE.sub("", text))
    return text.splitlines()[0][:300] if text else type(error).__name__
