"""The control plane's datagrams: typed, signed with the job's key, checked before anything uses them.

    datagram = tag (32 bytes) + body (UTF-8 JSON, at most MAX_BYTES)
    tag      = HMAC-SHA256(job key, body)
    body     = {"kind": ..., "job": token, "from": sender, "n": counter, ...the kind's fields}

A member's sender is its id (its first rank); a joining server's is "join-<nonce>". The counter
grows with every datagram a process sends (it starts from the clock, so a restarted server's
counter is past its earlier one's): a receiver keeps the highest counter each sender reached and
refuses anything at or below it, so a replayed datagram is refused as surely as a forged one.
The generation ("g") and the job's token are inside the signed body too.

Each kind has a dataclass whose `parse` checks every field for type and range; `Envelope.open`
raises Rejected (with a short reason, for the counts) for anything else.
"""

import dataclasses
import hashlib
import hmac
import json
import re
import threading
import time

MAX_BYTES = 60_000  # a decision names every member's address: room for hundreds, and under UDP's limit
MAX_ID = 4095  # member ids: ranks, and the ranks joining servers are given
MAX_GENERATION = 2**31
TAG_BYTES = 32
HEX = re.compile(r"[0-9a-f]{1,64}")
NAME = re.compile(r"\d{1,10}\.\d{1,4}\.[0-9a-f]{8}")  # a group's store prefix: generation.leader.random
JOINER = re.compile(r"join-[0-9a-f]{12}")
STATES = ("training", "recovering", "growing", "fenced")
MAX_SENDERS = 10_000  # counters kept; the oldest joiners' are forgotten past this


class Rejected(Exception):
    """A datagram that failed a check; str() is the reason, counted by kind of failure."""


def need(ok, reason):
    if not ok:
        raise Rejected(reason)


def integer(value, low=0, high=MAX_GENERATION):
    need(type(value) is int and low <= value <= high, "field out of range")
    return value


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


def entry(value):
    """A member's book entry: its control address, its job's pid and its host's name."""
    need(type(value) is dict and set(value) == {"address", "pid", "host"}, "bad book entry")
    need(type(value["pid"]) in (int, str) and len(str(value["pid"])) <= 20, "bad book entry")
    return {"address": address(value["address"]), "pid": value["pid"], "host": text(value["host"], 255)}


def table(value, check_key, check_value, limit=MAX_ID + 1):
    need(type(value) is dict and len(value) <= limit, "bad table")
    return {check_key(k): check_value(v) for k, v in value.items()}


def id_key(key):
    need(type(key) is str and key.isdigit() and len(key) <= 4, "bad table")
    member(int(key))
    return key


@dataclasses.dataclass(frozen=True)
class Alive:
    """Every member, every heartbeat/5 s (every 50 ms while recovering): its generation and state."""

    g: int
    state: str
    report: list | None = None  # while recovering: [epoch, step] this rank last completed
    attempt: int = 0  # while recovering: which try at forming the next generation
    lost: int | None = None  # the member this rank saw fall silent or refuse

    @classmethod
    def parse(cls, f):
        need(f.get("state") in STATES, "bad state")
        return cls(
            integer(f.get("g")),
            f["state"],
            optional(position, f.get("report")),
            integer(f.get("attempt"), 0, 1000),
            optional(member, f.get("lost")),
        )


@dataclasses.dataclass(frozen=True)
class Decision:
    """The leader's: the next generation's members, where they meet, whose state they take."""

    g: int
    name: str  # the new group's store prefix
    members: list
    store: list  # [host, port] of the leader's store
    source: int  # the member at the furthest position: it sends its state to the others
    position: list
    reports: dict = dataclasses.field(default_factory=dict)  # {"id": [epoch, step]}
    attempt: int | None = None  # a recovery's try; None: a growth
    book: dict = dataclasses.field(default_factory=dict)  # a growth: {"id": entry} of every member
    joined: dict = dataclasses.field(default_factory=dict)  # a growth: {nonce: id} of the servers taken in

    @classmethod
    def parse(cls, f):
        decision = cls(
            integer(f.get("g"), 1),
            text(f.get("name"), 40, NAME),
            members(f.get("members")),
            address(f.get("store")),
            member(f.get("source")),
            position(f.get("position")),
            table(f.get("reports", {}), id_key, position),
            optional(integer, f.get("attempt"), 0, 1000),
            table(f.get("book", {}), id_key, entry),
            table(f.get("joined", {}), lambda k: text(k, 12, HEX), member, 64),
        )
        need(decision.source in decision.members, "bad source")
        need(all(int(m) in decision.members for m in decision.reports), "bad reports")
        need(all(m in decision.members for m in decision.joined.values()), "bad joined")
        return decision


@dataclasses.dataclass(frozen=True)
class FencedOut:
    """To a member of an older generation that speaks up: the job went on without it (at g)."""

    g: int

    @classmethod
    def parse(cls, f):
        return cls(integer(f.get("g"), 1))


@dataclasses.dataclass(frozen=True)
class Join:
    """A new server asks to be taken in (any member passes it to the leader)."""

    nonce: str
    want: int | None  # its old rank, if free
    settings: dict  # what must be alike (utils.config.Config.must_agree, the model)
    entry: dict  # its book entry
    identity: dict  # utils.program.identity(): torch's version, the program's digest

    @classmethod
    def parse(cls, f):
        settings = table(f.get("settings"), lambda k: text(k, 40), scalar, 64)
        identity = table(f.get("identity"), lambda k: text(k, 16), lambda v: text(v, 64), 4)
        need(set(identity) == {"torch", "program"}, "bad identity")
        return cls(
            text(f.get("nonce"), 12, HEX), optional(member, f.get("want")), settings, entry(f.get("entry")), identity
        )


@dataclasses.dataclass(frozen=True)
class Refused:
    """To a joining server: why the job will not take it in."""

    nonce: str
    reason: str

    @classmethod
    def parse(cls, f):
        return cls(text(f.get("nonce"), 12, HEX), text(f.get("reason"), 600))


def scalar(value):
    need(value is None or type(value) in (bool, int, float, str), "bad setting")
    need(type(value) is not str or len(value) <= 256, "bad setting")
    return value


KINDS = {"alive": Alive, "decision": Decision, "fenced": FencedOut, "join": Join, "refused": Refused}
NAMES = {cls: name for name, cls in KINDS.items()}
REQUIRED = {
    cls: {f.name for f in dataclasses.fields(cls) if f.default is f.default_factory is dataclasses.MISSING}
    for cls in KINDS.values()
}


def identity(name):
    """A member's id, or a joining server's name ("join-" and 12 hex digits)."""
    return type(name) is int and 0 <= name <= MAX_ID or type(name) is str and JOINER.fullmatch(name) is not None


class Envelope:
    """One process's signer and checker: `seal` a message from `sender`; `open` a datagram."""

    def __init__(self, key, sender):
        self.key, self.sender, self.job = key, sender, ""
        self.counter = 0
        self.highest = {}  # sender -> the highest counter accepted from it
        self.lock = threading.Lock()

    def seal(self, message, to=None, job=None):
        """The datagram of a message (one of KINDS' classes) for `to` (a member, a joiner's name, or
        None: a join request, for any member), under this process's next counter."""
        with self.lock:
            self.counter = max(self.counter + 1, time.time_ns())
            counter = self.counter
        fields = {"kind": NAMES[type(message)], "job": self.job if job is None else job, "from": self.sender, "to": to}
        body = json.dumps(dict(fields, n=counter, **dataclasses.asdict(message)), separators=(",", ":")).encode()
        return hmac.new(self.key, body, hashlib.sha256).digest() + body

    def open(self, datagram):
        """(sender, job, message) of a genuine, fresh, well-formed datagram; else raises Rejected."""
        need(TAG_BYTES < len(datagram) <= TAG_BYTES + MAX_BYTES, "size")
        tag, body = datagram[:TAG_BYTES], datagram[TAG_BYTES:]
        need(hmac.compare_digest(tag, hmac.new(self.key, body, hashlib.sha256).digest()), "signature")
        try:
            fields = json.loads(body)
        except (ValueError, RecursionError):
            raise Rejected("not JSON") from None
        need(type(fields) is dict and fields.get("kind") in KINDS, "kind")
        sender, counter, to = fields.pop("from", None), fields.pop("n", None), fields.pop("to", None)
        need(identity(sender), "sender")
        need(to is None or identity(to), "receiver")
        need(type(counter) is int and counter > 0, "counter")
        kind, job = KINDS[fields.pop("kind")], text(fields.pop("job", None), 16)
        need(set(fields) <= {f.name for f in dataclasses.fields(kind)}, "unknown field")
        need(REQUIRED[kind] <= set(fields), "field missing")
        try:
            message = kind.parse(fields)
        except (TypeError, ValueError, KeyError, AttributeError):  # (parse checks types first: a slip is caught)
            raise Rejected("bad field") from None
        # Bound to its receiver: a datagram sealed for another rank, replayed here, is refused even
        # when this rank missed the sender's newer ones. A joining server cannot know the member id it
        # will have, so it takes what is sealed for any member (its counters still hold).
        joining = type(self.sender) is str and type(to) is int
        need(to == self.sender or joining or (to is None and kind is Join), "not for this rank")
        with self.lock:
            need(counter > self.highest.get(sender, 0), "replay")
            self.highest[sender] = counter
            if len(self.highest) > MAX_SENDERS:
                del self.highest[next(s for s in self.highest if type(s) is str)]
        return sender, job, message
