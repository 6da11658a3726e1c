"""The control plane's datagrams: typed, signed with the job's key, checked before anything uses them.

    datagram = tag (32 bytes) + body (UTF-8 JSON, at most MAX_BYTES)
    tag      = HMAC-SHA256(job key, body)
    body     = {"kind": ..., "job": token, "from": sender, "n": counter, ...the kind's fields}

A member's sender is its id (its first rank); a joining server's is "join-<nonce>"; train.py
--status, which only asks (Ask) and is answered (Status), is "status-<nonce>"; train.py --stop,
which asks one member to stop the job (Stop) and is answered (Stopping), is "stop-<nonce>". The counter
grows with every datagram a process sends (it starts from the clock, so a restarted server's
counter is past its earlier one's): a receiver keeps the highest counter each sender reached and
refuses anything at or below it, so a replayed datagram is refused as surely as a forged one.
The generation ("g") and the job's token are inside the signed body too.

Each kind has a dataclass whose `parse` checks every field for type and range (the checks:
utils/elastic/checks.py); `Envelope.open` raises Rejected (with a short reason, for the counts)
for anything else.
"""

import dataclasses
import hashlib
import hmac
import json
import re
import threading
import time

from utils.elastic.checks import (
    HEX,
    MAX_ID,
    Rejected,
    address,
    entry,
    id_key,
    integer,
    listed,
    member,
    members,
    need,
    optional,
    position,
    progress,
    scalar,
    table,
    text,
)

MAX_BYTES = 60_000  # a decision names every member's address: room for hundreds, and under UDP's limit
TAG_BYTES = 32
NAME = re.compile(r"\d{1,10}\.\d{1,4}\.[0-9a-f]{8}")  # a group's store prefix: generation.leader.random
JOINER = re.compile(r"join-[0-9a-f]{12}")
ASKER = re.compile(r"status-[0-9a-f]{12}")  # train.py --status: not a member, it only asks
STOPPER = re.compile(r"stop-[0-9a-f]{12}")  # train.py --stop: not a member either
STATES = ("training", "recovering", "growing", "fenced")
MAX_SENDERS = 10_000  # counters kept; the oldest joiners' are forgotten past this


@dataclasses.dataclass(frozen=True)
class Alive:
    """Every member, every heartbeat/5 s (every 50 ms while recovering): its generation and state."""

    g: int
    state: str
    report: list | None = None  # while recovering: [epoch, step] this rank last completed
    attempt: int = 0  # while recovering: which try at forming the next generation
    lost: int | None = None  # the member this rank saw fall silent or refuse
    progress: dict | None = None  # its training's progress (checks.PROGRESS), for train.py --status

    @classmethod
    def parse(cls, f):
        need(f.get("state") in STATES, "bad state")
        return cls(
            integer(f.get("g")),
            f["state"],
            optional(position, f.get("report")),
            integer(f.get("attempt"), 0, 1000),
            optional(member, f.get("lost")),
            optional(progress, f.get("progress")),
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
    settings: dict  # what must be alike (utils.setup.config.Config.must_agree, the model)
    entry: dict  # its book entry
    identity: dict  # utils.setup.program.identity(): torch's version, the program's digest

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


@dataclasses.dataclass(frozen=True)
class Ask:
    """train.py --status asks any member (sealed for none; its sender is "status-<nonce>")."""

    nonce: str

    @classmethod
    def parse(cls, f):
        return cls(text(f.get("nonce"), 12, HEX))


@dataclasses.dataclass(frozen=True)
class Status:
    """A member's answer to Ask, sealed for the asker: the generation, its state, every member in rank order."""

    nonce: str
    g: int
    state: str
    members: list

    @classmethod
    def parse(cls, f):
        need(f.get("state") in STATES, "bad state")
        listing = f.get("members")
        need(type(listing) is list and 0 < len(listing) <= MAX_ID + 1, "bad member list")
        status = cls(text(f.get("nonce"), 12, HEX), integer(f.get("g")), f["state"], [listed(m) for m in listing])
        need(len({m["id"] for m in status.members}) == len(status.members), "bad member list")
        return status


@dataclasses.dataclass(frozen=True)
class Stop:
    """train.py --stop asks a member to stop the job after a step (its sender is "stop-<nonce>").
    Sealed for that member and its job's token, which the stopper read in the member's Status: a
    Stop replayed to another member, or to a later run of the job (another token), is refused."""

    nonce: str

    @classmethod
    def parse(cls, f):
        return cls(text(f.get("nonce"), 12, HEX))


@dataclasses.dataclass(frozen=True)
class Stopping:
    """A member's answer to Stop, sealed for the stopper: it asked the job to stop after a step."""

    nonce: str

    @classmethod
    def parse(cls, f):
        return cls(text(f.get("nonce"), 12, HEX))


KINDS = {
    "alive": Alive,
    "decision": Decision,
    "fenced": FencedOut,
    "join": Join,
    "refused": Refused,
    "ask": Ask,
    "status": Status,
    "stop": Stop,
    "stopping": Stopping,
}
NAMES = {cls: name for name, cls in KINDS.items()}
REQUIRED = {
    cls: {f.name for f in dataclasses.fields(cls) if f.default is f.default_factory is dataclasses.MISSING}
    for cls in KINDS.values()
}


def identity(name):
    """A member's id, a joining server's name ("join-" and 12 hex digits), an asker's ("status-") or a
    stopper's ("stop-")."""
    if type(name) is int:
        return 0 <= name <= MAX_ID
    return type(name) is str and any(p.fullmatch(name) is not None for p in (JOINER, ASKER, STOPPER))


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
        joining = type(self.sender) is str and JOINER.fullmatch(self.sender) is not None and type(to) is int
        need(to == self.sender or joining or (to is None and kind in (Join, Ask)), "not for this rank")
        with self.lock:
            need(counter > self.highest.get(sender, 0), "replay")
            self.highest[sender] = counter
            if len(self.highest) > MAX_SENDERS:
                del self.highest[next(s for s in self.highest if type(s) is str)]
        return sender, job, message
