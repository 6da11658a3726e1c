"""The field checks of the control plane's messages (utils/elastic/wire.py): each returns the value
it was given, or raises Rejected with a short reason (counted by the receiver, by reason).

Nothing from the network is used before one of these has looked at it: JSON's types only (no
pickle), every number in its range, every text and table within its size.
"""

import math
import re

MAX_ID = 4095  # member ids: ranks, and the ranks joining servers are given
MAX_GENERATION = 2**31
HEX = re.compile(r"[0-9a-f]{1,64}")


class Rejected(Exception):
    """A datagram that failed a check; str() is the reason, counted by kind of failure."""


def need(ok, reason):
    if not ok:
        raise Rejected(reason)


def integer(value, low=0, high=MAX_GENERATION):
    need(type(value) is int and low <= value <= high, "field out of range")
    return value


def number(value, low=0.0, high=1e12):
    """A float (or an int) within [low, high]; NaN and infinities are refused."""
    need(type(value) in (int, float) and math.isfinite(value) and low <= value <= high, "field out of range")
    return float(value)


def optional(check, value, *args):
    return None if value is None else check(value, *args)


def text(value, limit=256, pattern=None):
    need(type(value) is str and len(value) <= limit, "bad text field")
    need(pattern is None or pattern.fullmatch(value), "bad text field")
    return value


def position(value):
    need(type(value) is list and len(value) == 2, "bad position")
    return [integer(value[0]), integer(value[1])]


def member(value):
    return integer(value, 0, MAX_ID)


def members(value):
    need(type(value) is list and 0 < len(value) <= MAX_ID + 1, "bad member list")
    need(len(set(map(member, value))) == len(value), "bad member list")
    return value


def address(value):
    need(type(value) is list and len(value) == 2, "bad address")
    return [text(value[0], 64), integer(value[1], 1, 65535)]


def pid(value):
    need(type(value) in (int, str) and len(str(value)) <= 20, "bad pid")
    return value


def entry(value):
    """A member's book entry: its control address, its job's pid and its host's name."""
    need(type(value) is dict and set(value) == {"address", "pid", "host"}, "bad book entry")
    return {"address": address(value["address"]), "pid": pid(value["pid"]), "host": text(value["host"], 255)}


def table(value, check_key, check_value, limit=MAX_ID + 1):
    need(type(value) is dict and len(value) <= limit, "bad table")
    return {check_key(k): check_value(v) for k, v in value.items()}


def id_key(key):
    need(type(key) is str and key.isdigit() and len(key) <= 4, "bad table")
    member(int(key))
    return key


def scalar(value):
    need(value is None or type(value) in (bool, int, float, str), "bad setting")
    need(type(value) is not str or len(value) <= 256, "bad setting")
    return value


MAX_STEPS = 10**9
MAX_SECONDS = 10**9  # 31 years
# A member's progress (utils/elastic/status.Record), in its heartbeats and in a status answer:
# field -> (check, its arguments); None is allowed where a value is not known yet (no step done).
PROGRESS = {
    "epoch": (integer, 0, MAX_STEPS),
    "epochs": (integer, 0, MAX_STEPS),
    "step": (integer, 0, MAX_STEPS),
    "steps": (integer, 0, MAX_STEPS),
    "images_per_second": (number, 0.0, 1e12),
    "share": (number, 0.0, 1.0),
    "loss": (number, 0.0, 1e30),
    "seconds_left": (number, 0.0, MAX_SECONDS),
    "host": (text, 255),
    "pid": (integer, 0, 2**31),
    "restarts": (integer, 0, 2**31),
    "rejoins": (integer, 0, 2**31),
}


def progress(value):
    """A member's progress record: exactly PROGRESS's fields, each checked (None where not known)."""
    need(type(value) is dict and set(value) == set(PROGRESS), "bad progress")
    return {name: optional(check, value[name], *args) for name, (check, *args) in PROGRESS.items()}


def listed(value):
    """One member in a status answer: its id, seconds since the answering member heard it (None:
    itself), its host and pid, its progress (None: no step reported yet)."""
    need(type(value) is dict and set(value) == {"id", "heard", "host", "pid", "progress"}, "bad member")
    return {
        "id": member(value["id"]),
        "heard": optional(number, value["heard"], 0.0, PROGRESS["seconds_left"][2]),
        "host": text(value["host"], 255),
        "pid": pid(value["pid"]),
        "progress": optional(progress, value["progress"]),
    }
