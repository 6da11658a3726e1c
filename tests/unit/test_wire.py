"""The control plane's datagrams (utils/elastic/wire.py) and the job's key (utils/elastic/key.py)."""

import dataclasses
import hashlib
import hmac
import os
import socket
import time

import pytest
from fuzz import SAMPLES, kind_of, mutations, signed

from utils.elastic import key
from utils.elastic.membership import Membership
from utils.elastic.wire import Alive, Envelope, FencedOut, Rejected
from utils.errors import UsageError

KEY = b"0123456789abcdef0123456789abcdef"


def sign(fields, secret=KEY):
    return signed(secret, fields)


def fields_of(message, n):
    return {"kind": kind_of(message), "job": "00ff", "from": 1, "to": 0, "n": n, **dataclasses.asdict(message)}


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_kind_goes_through_and_a_replay_is_refused(message):
    sender, receiver = Envelope(KEY, 1), Envelope(KEY, 0)
    sender.job = "00ff"
    datagram = sender.seal(message, to=0)
    assert receiver.open(datagram) == (1, "00ff", message)
    with pytest.raises(Rejected, match="replay"):
        receiver.open(datagram)
    with pytest.raises(Rejected, match="signature"):
        Envelope(b"another key of the same length!!", 0).open(sender.seal(message, to=0))


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_a_datagram_sealed_for_another_rank_is_refused_however_fresh(message):
    """Replayed to a rank it was not sealed for, even one that never heard the sender (its newer
    datagrams lost): refused. A joining server, which cannot know the id it will be given, takes
    what is sealed for a member; anyone takes a join request, which is for any member."""
    sender, other, joiner = Envelope(KEY, 1), Envelope(KEY, 0), Envelope(KEY, "join-" + "ab" * 6)
    for_rank_2 = sender.seal(message, to=2)
    with pytest.raises(Rejected, match="not for this rank"):
        other.open(for_rank_2)
    assert joiner.open(for_rank_2)[2] == message
    with pytest.raises(Rejected, match="not for this rank"):
        Envelope(KEY, "join-" + "cd" * 6).open(sender.seal(message, to="join-" + "ab" * 6))
    for_anyone = sender.seal(message)
    if type(message).__name__ in ("Join", "Ask"):  # (for any member: a join request, a --status question)
        assert other.open(for_anyone)[2] == message
    else:
        with pytest.raises(Rejected, match="not for this rank"):
            other.open(for_anyone)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_each_field_missing_wrong_or_huge_is_refused(message):
    """What gets through is a field left out that has a default, or a small value of the field's
    own type (an empty table, another text): a valid message of its kind."""
    receiver, kind = Envelope(KEY, 0), fields_of(message, 0)["kind"]
    defaults = {f.name for f in dataclasses.fields(message) if f.default is not dataclasses.MISSING}
    defaults |= {f.name for f in dataclasses.fields(message) if f.default_factory is not dataclasses.MISSING}
    original, through = dataclasses.asdict(message), []
    for n, (name, value, fields) in enumerate(mutations(message), start=1):
        try:
            parsed = receiver.open(sign({"kind": kind, "job": "", "from": 1, "to": 0, "n": n, **fields}))
        except Rejected:
            continue
        assert type(parsed[2]) is type(message)
        through.append(name)
        if value is dataclasses.MISSING:
            assert name in defaults, f"{name} missing got through"
        else:
            assert type(value) is type(original[name]) and len(str(value)) < 100, f"{name}={value!r} got through"
    assert len(through) < 3 * len(original)  # nearly everything is refused


def test_random_bytes_and_broken_envelopes_are_refused():
    receiver, rng = Envelope(KEY, 0), __import__("random").Random(1)
    for size in (0, 1, 3, 31, 32, 33, 100, 1500, 65_000):
        with pytest.raises(Rejected):
            receiver.open(bytes(rng.getrandbits(8) for _ in range(size)))
    for fields in (
        [1],
        "x",
        None,
        {"kind": "join"},
        {"kind": "nope", "from": 1, "n": 5},
        {"kind": "alive", "from": True},
    ):
        with pytest.raises(Rejected):
            receiver.open(sign(fields))
    with pytest.raises(Rejected, match="unknown field"):
        receiver.open(sign({**fields_of(FencedOut(2), 9), "extra": 1}))
    with pytest.raises(Rejected, match="not JSON"):
        receiver.open(hmac.new(KEY, b"[[[[", hashlib.sha256).digest() + b"[[[[")
    with pytest.raises(Rejected):  # deep nesting is refused, not a RecursionError
        body = b"[" * 50_000 + b"]" * 50_000
        receiver.open(hmac.new(KEY, body, hashlib.sha256).digest() + body)


def test_a_restarted_sender_counts_on_from_where_it_was():
    receiver, first = Envelope(KEY, 0), Envelope(KEY, 1)
    receiver.open(first.seal(FencedOut(1), to=0))
    restarted = Envelope(KEY, 1)  # a new process under the same id: its counter starts from the clock
    assert receiver.open(restarted.seal(FencedOut(1), to=0))[0] == 1


def test_a_member_counts_bad_datagrams_and_its_threads_live_on():
    member = Membership(0, 5.0, "127.0.0.1", KEY)
    peer = Membership(1, 5.0, "127.0.0.1", KEY)
    book = {
        0: {"address": list(member.address), "pid": 1, "host": "h"},
        1: {"address": list(peer.address), "pid": 2, "host": "h"},
    }
    member.start(book, "00ff")
    peer.start(book, "00ff")
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    forged = Envelope(b"not the job's key, but 32 bytes!", 1)
    forged.job = "00ff"
    for datagram in [
        b"[1]",
        b'{"t":"join"}',
        os.urandom(3),
        os.urandom(2000),
        forged.seal(Alive(9, "recovering", [1, 1])),
    ]:
        attacker.sendto(datagram, member.address)
    deadline = time.monotonic() + 10
    while sum(member.detector.rejected.values()) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert member.detector.rejected["size"] == 3 and member.detector.rejected["signature"] == 2, (
        member.detector.rejected
    )
    assert {t.name for t in __import__("threading").enumerate()} >= {"membership-receive", "membership-beat"}
    time.sleep(0.5)  # the peer's beats still count
    assert not member.broken.is_set() and time.monotonic() - member.detector.heard[1] < 1.0


def test_the_key_from_a_file_the_environment_or_a_copy(tmp_path):
    path = tmp_path / "job.key"
    path.write_text("f" * 64 + "\n")
    path.chmod(0o600)
    assert key.given(str(path), {}) == b"f" * 64
    assert key.given(None, {"RING_KEY_FILE": str(path)}) == b"f" * 64
    assert key.given(None, {"RING_JOB_KEY": "e" * 64}) == b"e" * 64
    assert key.given(None, {}) is None
    path.chmod(0o644)
    with pytest.raises(UsageError, match="can be read by other users; make it yours alone: chmod 600"):
        key.given(str(path), {})
    with pytest.raises(UsageError, match="at least 16"):
        key.given(None, {"RING_JOB_KEY": "short"})
    with pytest.raises(UsageError, match="cannot read --key-file"):
        key.given(str(tmp_path / "none"), {})
    checkpoint = str(tmp_path / "runs" / "checkpoint.pt")
    with pytest.raises(UsageError, match=r"no key .* give --key-file PATH, a copy of .*checkpoint.pt.key"):
        key.for_joining(None, checkpoint, {})
    made = key.new()
    key.keep(made, checkpoint)
    assert os.stat(checkpoint + ".key").st_mode & 0o777 == 0o600
    assert key.for_joining(None, checkpoint, {}) == made and len(made) == 64
