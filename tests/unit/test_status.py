"""train.py --status's question and answer (utils/elastic/status.py, wire.py's Ask and Status), the
progress a member's heartbeats carry, and rank 0's progress reports (utils/observe/watch.py)."""

import time

import pytest

from utils.elastic import status
from utils.elastic.checks import PROGRESS
from utils.elastic.membership import Membership
from utils.elastic.wire import Alive, Ask, Envelope, FencedOut, Rejected, Status
from utils.errors import UsageError
from utils.observe.watch import Watch, every

KEY = b"0123456789abcdef0123456789abcdef"
ASKER = "status-" + "ab" * 6


def test_a_record_reports_its_window_and_the_time_left():
    record = status.Record(epochs=2)
    assert record.snapshot() is None  # no step yet
    for step in range(1, 31):
        record.stepped(1, step, 100, 32, 64, 0.5 if step > 10 else 5.0, 0.25)
    snap = record.snapshot()
    assert set(snap) == set(PROGRESS)
    assert snap["images_per_second"] == pytest.approx(64.0)  # the last 20 steps: 32 images in 0.5 s each
    assert snap["seconds_left"] == pytest.approx((70 + 100) * 0.5)
    assert (snap["epoch"], snap["step"], snap["steps"], snap["share"], snap["loss"]) == (1, 30, 100, 0.5, 0.25)
    record.stepped(1, 31, 100, 32, 64, 0.5, float("nan"))  # a loss that is not a number is not sent
    assert record.snapshot()["loss"] is None


def test_progress_in_a_heartbeat_is_checked_field_by_field():
    good = status.Record(3)
    good.stepped(1, 1, 10, 3, 6, 0.1, 2.3)
    sender, receiver = Envelope(KEY, 1), Envelope(KEY, 0)
    assert receiver.open(sender.seal(Alive(1, "training", progress=good.snapshot()), to=0))[2].progress["share"] == 0.5
    for name, bad in [("share", 1.5), ("loss", -1.0), ("host", "h" * 300), ("pid", "1"), ("epoch", True)]:
        with pytest.raises(Rejected):
            receiver.open(sender.seal(Alive(1, "training", progress=dict(good.snapshot(), **{name: bad})), to=0))
    with pytest.raises(Rejected, match="bad progress"):
        receiver.open(sender.seal(Alive(1, "training", progress=dict(good.snapshot(), extra=1)), to=0))


def test_an_asker_takes_only_what_is_sealed_for_it():
    member, asker = Envelope(KEY, 0), Envelope(KEY, ASKER)
    assert member.open(asker.seal(Ask("ab" * 6)))[2] == Ask("ab" * 6)  # a question for any member
    answer = Status("ab" * 6, 1, "training", [{"id": 0, "heard": None, "host": "h", "pid": 1, "progress": None}])
    assert asker.open(member.seal(answer, to=ASKER))[2] == answer
    with pytest.raises(Rejected, match="not for this rank"):  # unlike a joining server, it takes nothing for a member
        asker.open(member.seal(FencedOut(3), to=1))
    with pytest.raises(Rejected, match="not for this rank"):
        Envelope(KEY, "status-" + "cd" * 6).open(member.seal(answer, to=ASKER))


def started_pair():
    """Two members on loopback, each with a record of a few steps."""
    a, b = Membership(0, 5.0, "127.0.0.1", KEY), Membership(1, 5.0, "127.0.0.1", KEY)
    book = {m.me: {"address": list(m.address), "pid": 100 + m.me, "host": "h"} for m in (a, b)}
    for m in (a, b):
        record = status.Record(2)
        record.stepped(1, 5 + m.me, 30, 32, 64, 0.1, 1.5)
        m.carry(record)
        m.start(book, "00ff")
    return a, b


def test_any_member_answers_for_every_member_and_a_wrong_key_gets_nothing():
    a, b = started_pair()
    time.sleep(1.2)  # a beat or two: each has the other's progress
    source, token, answer = status.ask("127.0.0.1", a.address[1], KEY, seconds=3)
    assert token == "00ff"  # (what train.py --stop seals its Stop for)
    job = status.summary(source, answer)
    assert [m["rank"] for m in job["members"]] == [0, 1] and job["generation"] == 0
    assert [m["step"] for m in job["members"]] == [5, 6] and all(m["share"] == 0.5 for m in job["members"])
    assert all(None not in m.values() for m in job["members"]), job
    lines = status.table(job)
    assert len(lines) == 4 and lines[1].split()[:3] == ["rank", "host", "pid"], lines
    before = a.detector.rejected["signature"] + b.detector.rejected["signature"]
    assert status.ask("127.0.0.1", a.address[1], b"another key, of thirty-two bytes", seconds=0.5) is None
    assert a.detector.rejected["signature"] + b.detector.rejected["signature"] > before
    spoofed = Envelope(KEY, ASKER).seal(Ask("cd" * 6))  # a name that is not its question's
    __import__("socket").socket(2, 2).sendto(spoofed, tuple(a.address))
    deadline = time.monotonic() + 5
    while not a.detector.rejected["sender"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.detector.rejected["sender"] == 1


def test_addresses_of_the_status_question():
    assert status.address_of("localhost:29500", None) == ("127.0.0.1", 29500)
    assert status.address_of("", "tcp://127.0.0.1:23456") == ("127.0.0.1", 23456)
    for where, init in [("nohost", None), ("h:0", None), ("h:99999", None), ("", None), ("", "env://")]:
        with pytest.raises(UsageError):
            status.address_of(where, init)


class Stats:
    def __init__(self):
        self.loss_sum, self.steps, self.step_seconds, self.comm_seconds = 0.0, 0, 0.0, 0.0


class Board:
    def __init__(self):
        self.points, self.texts = [], []

    def scalars(self, step, values):
        self.points += [(tag, step, value) for tag, value in values.items()]

    def text(self, tag, words, step):
        self.texts.append((tag, words, step))

    def flush(self):
        pass


def test_rank_0_reports_the_loss_every_tenth_of_an_epoch_and_each_change():
    board, stats = Board(), Stats()
    watch = Watch(status.Record(1), lambda at: board, lambda: 0.001)
    watch.members([0, 1, 2], 0, True)
    watch.begin(1, stats)
    for step in range(1, 26):
        stats.loss_sum, stats.steps, stats.step_seconds = stats.loss_sum + step, step, stats.step_seconds + 0.1
        watch.step(1, step, 25, 10, 30, 0.1, stats)
    watch.members([0, 2], 25, True)
    losses = watch.epoch(25, 0.9, 1000)
    assert every(25) == 2 and [s for s, _ in losses] == [*range(2, 25, 2), 25] and watch.losses == []
    assert losses[0][1] == 1.5 and losses[-1][1] == 25  # the mean since the report before
    tags = {tag for tag, _, _ in board.points}
    assert {"train/loss", "time/step_seconds", "time/comm_share", "train/learning_rate", "job/members"} <= tags
    assert {"test/accuracy", "comm/bytes_per_step"} <= tags
    assert board.texts == [("job/membership", "lost 1: 2 members (0, 2)", 25)]
