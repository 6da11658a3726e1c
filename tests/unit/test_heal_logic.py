"""A job heals itself: the pure parts. The keeper's backoff (utils/setup/keeper.py), the choice
between joining, resuming and starting (utils/elastic/rejoin.py); a left-behind server's wait for its
job over a fake transport: tests/unit/test_lifecycle.py. The real processes: tests/world/test_heal.py."""

import json

import pytest
from slurm_env import TASK

from utils.elastic import rejoin
from utils.elastic.rejoin import Checkpoint, How, choose, known_members, per_server
from utils.errors import UsageError
from utils.setup.config import Job, from_args
from utils.setup.handoff import Handoff
from utils.setup.keeper import Backoff, describe


def test_the_backoff_doubles_to_its_cap_and_gives_up_after_the_limit():
    b = Backoff(limit=8, first=1.0, most=60.0)
    delays = [b.failed(trained=False) for _ in range(8)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert b.failed(trained=False) is None  # the 9th failure in a row: given up


def test_a_child_that_trained_starts_the_backoff_again():
    """A storm is a server that fails before it trains again; one that trains between faults is back
    after a second each time."""
    b = Backoff(limit=3, first=1.0, most=60.0)
    assert [b.failed(False), b.failed(False), b.failed(False)] == [1.0, 2.0, 4.0]
    assert b.failed(trained=True) == 1.0
    assert [b.failed(True) for _ in range(10)] == [1.0] * 10
    assert [b.failed(False), b.failed(False)] == [2.0, 4.0]
    assert b.failed(False) is None


def test_exit_codes_are_said_in_words():
    assert describe(-9) == "killed by SIGKILL" and describe(1) == "lost the job (exit 1)" and describe(7) == "exit 7"


@pytest.mark.parametrize(
    "answered, checkpoint, resume, how",
    [
        (True, Checkpoint.UNFINISHED, False, How.JOIN),  # a running job wins over any checkpoint
        (True, Checkpoint.NONE, True, How.JOIN),
        (False, Checkpoint.UNFINISHED, False, How.RESUME),  # the job stopped as a whole: resume, no flag needed
        (False, Checkpoint.FINISHED, False, How.START),  # a finished run: a new one, as ever
        (False, Checkpoint.FINISHED, True, How.RESUME),  # --resume on a finished run: "nothing to do"
        (False, Checkpoint.OTHER, False, How.START),  # another run's settings: set aside, start afresh
        (False, Checkpoint.NONE, False, How.START),
    ],
)
def test_the_same_command_joins_resumes_or_starts(answered, checkpoint, resume, how):
    assert choose(answered, checkpoint, resume) == how


def test_the_kept_members_are_checked_before_use(tmp_path):
    checkpoint = str(tmp_path / "c.pt")
    book = {
        0: {"address": ["10.0.0.1", 29500]},
        1: {"address": ["10.0.0.2", 29501]},
        2: {"address": ["10.0.0.1", 29500]},
    }
    rejoin.keep_book(book, checkpoint)
    assert known_members(checkpoint) == [("10.0.0.1", 29500), ("10.0.0.2", 29501)]
    path = rejoin.book_path(checkpoint)
    for text in ("not json", "{}", '[["a", 1, 2]]', '[["h", 0]]', '[["h", 70000]]', "[[1, 2]]", '[["h", "1"]]'):
        with open(path, "w") as f:
            f.write(text)
        assert known_members(checkpoint) == [], text
    with open(path, "w") as f:
        json.dump([["h", 1000 + i] for i in range(1000)], f)
    assert len(known_members(checkpoint)) == 128  # a long list is cut, not read whole
    rejoin.forget_book(checkpoint)
    assert known_members(checkpoint) == []


def test_only_a_servers_own_command_looks_for_its_job():
    server = Job(rank=1, world_size=3, init_method="tcp://10.0.0.1:29500")
    assert per_server(server, Handoff())
    assert not per_server(server, Handoff(launched_locally=True))  # a rank of the local launcher
    assert not per_server(Job(rank=1, world_size=3, init_method="env://", torchrun=True), Handoff())
    assert not per_server(Job(rank=1, world_size=3, init_method="tcp://h:1", recover=False), Handoff())
    assert not per_server(Job(rank=0, world_size=1, init_method="tcp://h:1"), Handoff())
    assert not per_server(Job(rank=None), Handoff())


def test_the_joined_line_says_how_long_the_server_was_out():
    assert rejoin.absence(Handoff()) == ""
    note = rejoin.absence(Handoff(out_since=0.0, restarts=2))
    assert note.startswith("; back after ") and note.endswith(" s out (restart 2)")
    with pytest.raises(UsageError):  # a time that is not one: refused where the handoff is read, in one line
        Handoff.from_environ({"RING_HANDOFF": '{"out_since": "soon"}'})


def test_restart_is_for_a_servers_own_command_and_refused_where_others_restart():
    import train

    def config(*argv, environ=None):
        return from_args(train.parse_args(list(argv)), environ or {})

    server = ["--rank", "1", "--world-size", "3", "--init-method", "tcp://10.0.0.1:29500"]
    job = config(*server, "--restart", "on-failure", "--max-restarts", "4", "--rejoin-timeout", "0").job
    assert (job.restart, job.max_restarts, job.rejoin_timeout) == ("on-failure", 4, 0.0)
    for environ, who in (({"RANK": "1", "WORLD_SIZE": "3"}, "torchrun"), (TASK, "Slurm")):
        with pytest.raises(UsageError, match=f"{who} restarts its ranks itself"):
            config("--restart", "on-failure", environ=environ)
    with pytest.raises(UsageError, match="give --rank, --world-size and --init-method"):
        config("--restart", "on-failure")  # the local launcher
    for bad in (["--max-restarts", "0"], ["--rejoin-timeout", "-1"], ["--restart", "always"]):
        with pytest.raises(UsageError):
            train.parse_args([*server, *bad])


def test_the_systemd_unit_runs_a_servers_command_and_restarts_only_its_failures():
    import configparser
    import os
    import shlex

    from conftest import REPO

    import train

    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(os.path.join(REPO, "scripts", "mnist-ring.service"))
    service = unit["Service"]
    assert service["Restart"] == "on-failure" and unit["Install"]["WantedBy"] == "multi-user.target"
    assert set(service["RestartPreventExitStatus"].split()) == {"2", "3", "4"} and service["SuccessExitStatus"] == "3"
    words = shlex.split(service["ExecStart"])
    assert words[1:3] == ["-u", "train.py"]
    filled = {"EDIT-rank-0-address:23456": "10.0.0.1:23456", "EDIT-card": "lo"}
    words = [filled.get(w, w).replace("tcp://EDIT-rank-0-address", "tcp://10.0.0.1") for w in words]
    words = [("3" if before == "--world-size" else "1") if w == "EDIT" else w for before, w in zip(["", *words], words)]
    args = train.parse_args(words[3:])
    assert args.restart == "never"  # systemd is the keeper
    job = from_args(args, {}).job
    assert job.rank == 1 and job.init_method == "tcp://10.0.0.1:23456" and job.ifname is not None
