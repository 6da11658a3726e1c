"""One lifecycle: the supervisor's states and transitions (utils/setup/lifecycle.py), the keeper's
decision after a child (utils/setup/keeper.py), and the handoff between processes (utils/setup/handoff.py).
A left-behind server's wait runs over a fake transport and a fake clock. The real processes:
tests/world/test_heal.py, tests/world/test_keeper.py."""

import json

import pytest

import train
from utils.elastic import rejoin
from utils.errors import Outcome, PeerError, UsageError
from utils.observe.instruments import Instruments
from utils.setup.config import from_args
from utils.setup.handoff import VARIABLE, Handoff
from utils.setup.keeper import Backoff, after_child
from utils.setup.lifecycle import State, Supervisor, first_state, transition

SERVER = ["--rank", "1", "--world-size", "3", "--init-method", "tcp://10.0.0.1:29500"]


def config(tmp_path, *argv):
    return from_args(train.parse_args([*argv, "--checkpoint", str(tmp_path / "c.pt")]), {})


class Recorded(Instruments):
    """Instruments that remember what they were told."""

    def __init__(self):
        self.events, self.restarted = [], []

    def log(self, **event):
        self.events.append(event)

    def at_restart(self, rank):
        self.restarted.append(rank)


class FakeJob:
    """The transport a waiting server sees: the members answer from ask `answers_at` on (None:
    never); a whole restart forms at offer `forms_at` (None: never). Each call moves a fake clock.
    It plays both the members (ask) and train.py's rank (start, join)."""

    def __init__(self, answers_at=None, forms_at=None, seconds_per_call=5.0):
        self.answers_at, self.forms_at, self.seconds = answers_at, forms_at, seconds_per_call
        self.asks = self.offers = self.starts = self.joins = 0
        self.now = 0.0

    def ask(self, _config, _members):
        self.asks += 1
        self.now += self.seconds
        return self.answers_at is not None and self.asks >= self.answers_at

    def start(self, rendezvous_seconds=None):
        if rendezvous_seconds is None:  # a start that waits for every rank as long as --timeout
            self.starts += 1
            return True
        self.offers += 1
        self.now += self.seconds
        return self.forms_at is not None and self.offers >= self.forms_at

    def join(self):
        self.joins += 1
        return True

    def clock(self):
        return self.now


def waiting(tmp_path, job, deadline, instruments=None):
    """The supervisor of a server that lost its job and waits for it until `deadline`."""
    handoff = Handoff(rejoin_until=deadline, out_since=0.0, rejoins=1)
    return Supervisor(config(tmp_path, *SERVER), handoff, instruments or Recorded(), job.clock, job.ask)


def test_a_left_behind_server_joins_once_a_member_answers(tmp_path):
    job = FakeJob(answers_at=4)  # the cable comes back after three asks
    supervisor = waiting(tmp_path, job, deadline=300.0)
    assert supervisor.state == State.WAIT
    supervisor.run(job)
    assert supervisor.state == State.DONE and job.joins == 1 and job.starts == 0
    assert (job.asks, job.offers) == (4, 3)  # between asks it offered a whole restart, which did not form


def test_it_takes_part_in_a_whole_restart_when_no_job_is_left(tmp_path):
    job = FakeJob(forms_at=2)  # every other server came back to start the job again
    instruments = Recorded()
    supervisor = waiting(tmp_path, job, deadline=300.0, instruments=instruments)
    supervisor.run(job)
    assert supervisor.state == State.DONE and job.joins == 0
    assert (job.asks, job.offers) == (2, 2)
    said = [(e["event"], e["outcome"]) for e in instruments.events]  # (bench/heal/heal.py reads them)
    assert said == [("rejoin-ask", False), ("rejoin-offer", False), ("rejoin-ask", False), ("rejoin-offer", True)]


def test_it_gives_up_at_the_deadline_and_never_trains_alone(tmp_path):
    job = FakeJob()  # nobody answers, nobody comes: it must not form a job of its own
    supervisor = waiting(tmp_path, job, deadline=60.0)
    with pytest.raises(PeerError, match="waited 300 s") as caught:
        supervisor.run(job)
    assert caught.value.outcome == Outcome.GAVE_UP and caught.value.final and supervisor.state == State.GIVE_UP
    assert job.now <= 60.0 + job.seconds and job.asks - job.offers in (0, 1) and job.starts == 0


@pytest.mark.parametrize(
    "state, succeeded, out_of_time, then",
    [
        (State.START, True, False, State.DONE),
        (State.JOIN, True, False, State.DONE),
        (State.LOOK, True, False, State.JOIN),
        (State.LOOK, False, False, State.START),
        (State.WAIT, True, True, State.JOIN),  # an answer counts even at the deadline
        (State.WAIT, False, False, State.OFFER),
        (State.WAIT, False, True, State.GIVE_UP),
        (State.OFFER, True, True, State.DONE),  # the job ran in the restart it offered
        (State.OFFER, False, False, State.WAIT),
        (State.OFFER, False, True, State.GIVE_UP),
    ],
)
def test_the_transitions(state, succeeded, out_of_time, then):
    assert transition(state, succeeded, out_of_time) == then


def test_an_end_has_no_next_state():
    for end in (State.DONE, State.LOST, State.GIVE_UP, State.AGAIN):
        with pytest.raises(ValueError):
            transition(end, True)


def test_where_a_process_begins(tmp_path):
    server = config(tmp_path, *SERVER).job
    assert first_state(server, Handoff(), per_server=True) == State.LOOK
    assert first_state(server, Handoff(rejoin_until=1.0), per_server=True) == State.WAIT
    assert first_state(server, Handoff(), per_server=False) == State.START  # the local launcher's, torchrun's
    joining = config(tmp_path, *SERVER, "--join").job
    assert first_state(joining, Handoff(rejoin_until=1.0), per_server=True) == State.JOIN


def test_a_servers_command_asks_its_kept_members_first(tmp_path):
    """No members kept (no job here before, or it finished): it asks nobody and starts; else it asks
    once, and joins or starts."""
    job = FakeJob(answers_at=1)
    supervisor = Supervisor(config(tmp_path, *SERVER), Handoff(), Recorded(), job.clock, job.ask)
    assert supervisor.state == State.LOOK
    supervisor.run(job)
    assert (job.asks, job.starts, job.joins) == (0, 1, 0)
    rejoin.keep_book({0: {"address": ["10.0.0.1", 29501]}}, str(tmp_path / "c.pt"))
    for answers_at, starts, joins in ((1, 0, 1), (None, 1, 0)):
        job = FakeJob(answers_at=answers_at)
        Supervisor(config(tmp_path, *SERVER), Handoff(), Recorded(), job.clock, job.ask).run(job)
        assert (job.asks, job.starts, job.joins) == (1, starts, joins)


def test_a_restarted_process_fires_its_restart_faults_and_no_other_does(tmp_path):
    for restarts, fired in ((0, []), (2, [1])):
        instruments, job = Recorded(), FakeJob()
        handoff = Handoff(restarts=restarts, launched_locally=True)
        Supervisor(config(tmp_path, *SERVER), handoff, instruments, job.clock, job.ask).run(job)
        assert instruments.restarted == fired and job.starts == 1


@pytest.mark.parametrize(
    "outcome, signalled, rejoin_timeout, then",
    [
        (Outcome.LEFT_BEHIND, None, "300", State.AGAIN),
        (Outcome.FENCED, None, "300", State.AGAIN),
        (Outcome.FENCED, "SIGTERM", "300", State.LOST),  # stopped: it does not wait
        (Outcome.LEFT_BEHIND, None, "0", State.LOST),  # --rejoin-timeout 0: exit 1 at once
        (Outcome.LOST, None, "300", State.LOST),
        (Outcome.GAVE_UP, None, "300", State.GIVE_UP),
    ],
)
def test_after_a_lost_job(tmp_path, outcome, signalled, rejoin_timeout, then):
    supervisor = Supervisor(config(tmp_path, *SERVER, "--rejoin-timeout", rejoin_timeout), Handoff(), Recorded())
    assert supervisor.after(PeerError("lost", outcome), signalled) == then


def test_a_rank_of_the_local_launcher_never_waits_to_rejoin(tmp_path):
    supervisor = Supervisor(config(tmp_path, *SERVER), Handoff(launched_locally=True), Recorded())
    assert supervisor.after(PeerError("lost", Outcome.LEFT_BEHIND), None) == State.LOST


def test_the_keeper_restarts_failures_only():
    backoff = Backoff(limit=2, first=1.0, most=60.0)
    assert after_child(0, b"", False, backoff) == (State.DONE, None)  # finished
    assert after_child(2, b"", False, backoff) == (State.DONE, None)  # bad input: it would fail again
    assert after_child(3, b"", False, backoff) == (State.DONE, None)  # stopped, saved
    assert after_child(4, b"", False, backoff) == (State.DONE, None)  # NaN: it would meet it again
    assert after_child(-9, b"", True, backoff) == (State.DONE, None)  # a stop signal came meanwhile
    assert after_child(1, b"tf", False, backoff) == (State.DONE, None)  # it waited for its job in vain
    assert after_child(-9, b"", False, backoff) == (State.RESTART, 1.0)
    assert after_child(1, b"", False, backoff) == (State.RESTART, 2.0)
    assert after_child(1, b"", False, backoff) == (State.GIVE_UP, None)  # the third failure in a row
    assert after_child(1, b"t", False, Backoff(limit=2)) == (State.RESTART, 1.0)  # it trained: a new row


def test_the_handoff_goes_through_one_variable_and_back():
    handoff = Handoff(
        keeper_pipe=5,
        restarts=2,
        out_since=1.5,
        rejoins=1,
        rejoin_until=301.5,
        launched_locally=True,
        resume_command="python3 -u train.py --resume",
        job_pid=4321,
        torch_loaded_with={"OMP_NUM_THREADS": "1"},
    )
    env = handoff.environ({"PATH": "/bin", VARIABLE: "{}"})
    assert set(env) == {"PATH", VARIABLE} and Handoff.from_environ(env) == handoff
    assert Handoff.from_environ({}) == Handoff() and Handoff().environ({"PATH": "/bin"}) == {"PATH": "/bin"}
    assert json.loads(Handoff(restarts=3).environ({})[VARIABLE]) == {"restarts": 3}  # only what differs


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[1, 2]",
        '{"restarts": -1}',
        '{"restarts": "2"}',
        '{"restarts": true}',
        '{"restarts": 1e30}',
        '{"rejoins": 10000000000}',
        '{"keeper_pipe": -3}',
        '{"out_since": "soon"}',
        '{"rejoin_until": NaN}',
        '{"launched_locally": 1}',
        '{"resume_command": ["python3"]}',
        '{"job_pid": 0}',
        '{"torch_loaded_with": {"OMP_NUM_THREADS": 1}}',
        '{"secret": 1}',
        '{"restarts": 1' + " " * 70000 + "}",
    ],
)
def test_a_malformed_handoff_is_one_line_of_bad_input(text):
    with pytest.raises(UsageError, match=f"malformed {VARIABLE}") as caught:
        Handoff.from_environ({VARIABLE: text})
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 300
