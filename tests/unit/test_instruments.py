"""The instruments (utils/observe/instruments.py): off unless RING_INSTRUMENTS turns them on; a
malformed value is one line; a fault fires once, at its rank's step and phase; the event log."""

import signal

import pytest

from utils.errors import UsageError
from utils.observe.instruments import OFF, environ_for, from_environ, parse, read_events


def test_off_unless_turned_on():
    assert from_environ({}) is OFF and not OFF.enabled
    OFF.bind(0)
    OFF.at_step(1)  # (does nothing at all)
    assert from_environ(environ_for(faults="0:1:TERM")).enabled


@pytest.mark.parametrize(
    "value",
    ["{", "[1]", '{"faults": 3}', '{"fault": "0:1:KILL"}', '{"faults": "x:1:KILL"}', '{"faults": "0:1:NOPE"}']
    + ['{"pace": "x"}', '{"pace": "-1"}', '{"pace": "nan"}', '{"pace": "11"}', '{"pace": 0.1}'],
)
def test_a_malformed_value_is_one_line(value):
    with pytest.raises(UsageError, match="RING_INSTRUMENTS is malformed"):
        from_environ({"RING_INSTRUMENTS": value})


def test_pace_sleeps_as_each_step_begins_and_only_then(monkeypatch):
    import utils.observe.instruments as instruments

    slept = []
    monkeypatch.setattr(instruments.time, "sleep", slept.append)
    paced = from_environ(environ_for(pace=0.25))
    paced.bind(0)
    paced.at_step(1)
    paced.point("sum")
    paced.at_step(2)
    assert slept == [0.25, 0.25]
    unpaced = from_environ(environ_for(faults="0:9:TERM"))
    unpaced.bind(0)
    unpaced.at_step(1)
    assert slept == [0.25, 0.25]


def test_a_rank_s_faults_and_their_phases():
    spec = "1:25:KILL,0:25:STOP:sum,1:3:TERM:restart"
    assert parse(spec, 1) == [(25, signal.SIGKILL, "step"), (3, signal.SIGTERM, "restart")]
    assert parse(spec, 0) == [(25, signal.SIGSTOP, "sum")]
    assert parse(spec, 2) == []


def test_a_fault_fires_once_at_its_step_and_phase_and_is_logged(tmp_path):
    events, sent = tmp_path / "events.jsonl", []
    instruments = from_environ(environ_for(faults="0:3:TERM:sum", events=str(events)), send_to_self=sent.append)
    instruments.bind(0)
    instruments.at_step(3)  # (its phase is "sum": not yet)
    assert sent == []
    instruments.point("sum")
    instruments.point("sum")
    assert sent == [signal.SIGTERM]
    assert [(e["event"], e["step"], e["rank"]) for e in read_events(str(events))] == [("fault", 3, 0)]


def test_once_per_job_the_first_process_to_fire(tmp_path):
    once, sent = tmp_path / "once", []
    for _ in range(2):  # two processes of one job (a rank torchrun starts again)
        instruments = from_environ(environ_for(faults="0:1:TERM", once=str(once)), send_to_self=sent.append)
        instruments.bind(0)
        instruments.at_step(1)
    assert sent == [signal.SIGTERM]
