"""The two ways this program stops early, each reported as one line."""
import re


class UsageError(Exception):
    """Bad input from the user: an argument, a file, the data. Exit code 2."""


class PeerError(Exception):
    """The job broke off: a peer died, fell silent or never came. Exit code 1."""

    def __init__(self, message, resumable=True, doing="summing gradients"):
        super().__init__(message)
        self.resumable = resumable  # False before training started: there is nothing to resume
        self.doing = doing          # what the rank was doing, for the trainer's "lost a peer while ..."


def first_line(error):
    """The gist of an exception: its first line, without gloo's [source.cc:123] prefix."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())
    return text.splitlines()[0][:300] if text else type(error).__name__
