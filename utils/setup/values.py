"""The command line's value types (utils/setup/cli.py): a bad value is one line and exit code 2.

No torch here, as in cli.py: a bad command line is answered at once.
"""

import argparse
import math

from utils.errors import UsageError
from utils.setup.config import MAX_CHUNKS, MAX_SEED, MAX_TIMEOUT


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def positive(kind, most=None):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a {'number' if kind is float else 'whole number'}, got {text!r}"
            ) from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:g}, got {text!r}")
        return value

    return parse


def momentum_value(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {text!r}")
    return value


def seed_value(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be between 0 and {MAX_SEED}, got {text!r}")
    return value


def host_id_text(text):
    """--host-id: a name of up to 255 printable characters."""
    if not (0 < len(text) <= 255 and text.isprintable()):
        raise argparse.ArgumentTypeError(f"expected a name of 1 to 255 printable characters, got {text[:300]!r}")
    return text


def non_negative_int(text):
    return 0 if text.strip() == "0" else positive(int)(text)


def non_negative_float(text):
    return 0.0 if text.strip() in ("0", "0.0") else positive(float, MAX_TIMEOUT)(text)


def chunk_count(text):
    return "auto" if text == "auto" else positive(int, MAX_CHUNKS)(text)


def parse_steps(text):
    """'A:B' -> (A, B), 1 <= A <= B; ValueError with a message otherwise."""
    first, sep, last = text.partition(":")
    try:
        first, last = int(first), int(last)
    except ValueError:
        raise ValueError(f"expected FIRST:LAST step numbers, e.g. 21:60, not {text!r}") from None
    if not sep or first < 1 or last < first:
        raise ValueError(f"expected FIRST:LAST with 1 <= FIRST <= LAST, not {text!r}")
    return first, last


def timeline_steps(text):
    try:
        return parse_steps(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def port_number(text):
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port, 1-65535, got {text!r}")
    return int(text)
