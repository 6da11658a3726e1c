"""train.py --stop's request and its answer (utils/elastic/stopper.py, wire.py's Stop and Stopping),
a member's handling of it (utils/elastic/detector.py), and the request it hands on (utils/setup/stop.py).
Each kind's fields, missing, of a wrong type or huge: tests/unit/test_wire.py (bench/fuzz's SAMPLES)."""

import re
import socket
import time

import pytest

from utils.elastic import status, stopper
from utils.elastic.membership import Membership
from utils.elastic.wire import Envelope, Rejected, Stop, Stopping
from utils.errors import UsageError
from utils.learn.callbacks import StopSignals
from utils.setup import stop
from utils.sync.flags import Flags

KEY = b"0123456789abcdef0123456789abcdef"
NONCE = "ab" * 6
STOPPER = f"stop-{NONCE}"


def test_a_stop_goes_to_one_member_of_one_job_and_its_answer_to_the_stopper_alone():
    member, stopping = Envelope(KEY, 0), Envelope(KEY, STOPPER)
    datagram = stopping.seal(Stop(NONCE), to=0, job="00ff")
    assert member.open(datagram) == (STOPPER, "00ff", Stop(NONCE))
    with pytest.raises(Rejected, match="replay"):
        member.open(datagram)
    for to in (None, 1):  # unlike --status's question, a Stop is for the member that answered it
        with pytest.raises(Rejected, match="not for this rank"):
            member.open(stopping.seal(Stop(NONCE), to=to, job="00ff"))
    with pytest.raises(Rejected, match="signature"):
        member.open(Envelope(b"another key, of thirty-two bytes", STOPPER).seal(Stop(NONCE), to=0))
    with pytest.raises(Rejected, match="sender"):
        member.open(Envelope(KEY, "stop-xyz").seal(Stop(NONCE), to=0))
    answer = member.seal(Stopping(NONCE), to=STOPPER)
    assert stopping.open(answer)[2] == Stopping(NONCE)
    with pytest.raises(Rejected, match="not for this rank"):
        Envelope(KEY, "stop-" + "cd" * 6).open(member.seal(Stopping(NONCE), to=STOPPER))


def started_pair(requests):
    """Two members on loopback whose train.py --stop requests go into `requests`."""
    a, b = (Membership(m, 5.0, "127.0.0.1", KEY, request_stop=requests.append) for m in (0, 1))
    book = {m.me: {"address": list(m.address), "pid": 100 + m.me, "host": "h"} for m in (a, b)}
    for m in (a, b):
        m.start(book, "00ff")
    return a, b


def wait_until(predicate):
    deadline = time.monotonic() + 5
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_a_member_hands_a_genuine_stop_on_and_drops_the_others(tmp_path, capsys):
    requests = []
    a, b = started_pair(requests)
    source, token, answer = status.ask("127.0.0.1", a.address[1], KEY, seconds=3)
    taker = a if source[1] == a.address[1] else b
    assert not stopper.taken(b"another key, of thirty-two bytes", source, token, answer, time.monotonic() + 0.6)
    assert not stopper.taken(KEY, source, "beef", answer, time.monotonic() + 0.6)  # another run of the job
    spoofed = Envelope(KEY, STOPPER).seal(Stop("cd" * 6), to=taker.me, job=token)  # a name not its nonce's
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(spoofed, source)
    assert wait_until(lambda: taker.detector.rejected["sender"] == 1), taker.detector.rejected
    assert taker.detector.rejected["signature"] >= 1 and taker.detector.rejected["another job"] >= 1
    assert requests == [] and not a.broken.is_set() and not b.broken.is_set()

    (tmp_path / "job.key").write_bytes(KEY)
    (tmp_path / "job.key").chmod(0o600)
    stopper.command(f"127.0.0.1:{a.address[1]}", None, str(tmp_path / "job.key"), str(tmp_path / "c.pt"))
    line = capsys.readouterr().out
    taken_by = re.match(r"rank (\d) of the job \(127\.0\.0\.1:(\d+)\) took the stop: every rank stops", line)
    assert taken_by and [m.address[1] for m in (a, b)][int(taken_by[1])] == int(taken_by[2]), line
    assert set(requests) == {"train.py --stop from 127.0.0.1"}, requests


def test_a_membership_without_a_stop_to_hand_on_drops_a_stop():
    a = Membership(0, 5.0, "127.0.0.1", KEY)
    a.start({0: {"address": list(a.address), "pid": 1, "host": "h"}}, "00ff")
    found = status.ask("127.0.0.1", a.address[1], KEY, seconds=3)
    assert not stopper.taken(KEY, *found, time.monotonic() + 0.4)
    assert a.detector.rejected["no stop here"] >= 1


def test_a_request_is_a_first_signal_and_only_the_first_counts(monkeypatch):
    for name, value in (("_first", None), ("_armed", False), ("_leaving", False), ("_forward", None)):
        monkeypatch.setattr(stop, name, value)
    stop.request("train.py --stop from 10.0.0.5")  # before arm(): as a SIGUSR1, noted, not an exit
    stop.request("train.py --stop from 10.0.0.6")
    assert stop.signalled() == "train.py --stop from 10.0.0.5"
    assert StopSignals().flags(Flags()).stopping  # it rides with the next sum
    monkeypatch.setattr(stop, "_first", None)
    stop.leaving()  # the stop is done: a late request changes nothing
    stop.request("train.py --stop from 10.0.0.5")
    assert stop.signalled() is None


def test_addresses_of_the_stop():
    with pytest.raises(UsageError, match="--stop needs HOST:PORT"):
        stopper.command("", None, None, "c.pt")
    with pytest.raises(UsageError, match="malformed --stop 'nohost'"):
        stopper.command("nohost", None, None, "c.pt")
