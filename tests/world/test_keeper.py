"""The keeper of --restart on-failure (utils/setup/keeper.py) over small stand-in programs: what it
starts again, what ends it, and that a signal to it goes on to its child and ends it too, also one that
came before the child could take it."""

import signal
import subprocess
import sys
import textwrap
import time

import pytest

KEEP = textwrap.dedent(
    """
    import sys
    from utils.setup import keeper
    from utils.setup.handoff import Handoff
    say = lambda line: print(line, file=sys.stderr, flush=True)
    sys.exit(keeper.keep(sys.argv[2:], sys.argv[1], "prog: rank 1", 3, say, Handoff.from_environ()))
    """
)


def keep(tmp_path, program, *argv, timeout=60, keeper=KEEP):
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(program))
    return subprocess.run(
        [sys.executable, "-c", keeper, str(prog), *argv], capture_output=True, text=True, timeout=timeout, cwd=tmp_path
    )


def signal_once_started(tmp_path, program, sig):
    """Run the keeper of `program`, send it `sig` once the program has written "started": (its
    exit code, its stderr)."""
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(program))
    keeper = subprocess.Popen([sys.executable, "-c", KEEP, str(prog)], stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        keeper.send_signal(sig)
        _, err = keeper.communicate(timeout=30)
    finally:
        keeper.kill()
    return keeper.returncode, err


@pytest.mark.timeout(60)
def test_a_refusal_or_bad_input_is_not_started_again(tmp_path):
    result = keep(tmp_path, "import sys; sys.exit(2)")
    assert result.returncode == 2 and result.stderr == "", result.stderr


@pytest.mark.timeout(60)
def test_a_crash_is_started_again_with_the_same_arguments_until_it_succeeds(tmp_path):
    program = """
        import os, signal, sys
        from utils.setup.handoff import Handoff
        runs = len(os.listdir("."))  # prog.py, then one file a run
        open(f"run{runs}-{'-'.join(sys.argv[1:])}-{Handoff.from_environ().restarts}", "w").close()
        if runs == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(1 if runs == 2 else 0)
    """
    result = keep(tmp_path, program, "--rank", "1")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "prog: rank 1: training killed by SIGKILL; starting it again in 1 s (restart 1)",
        "prog: rank 1: training lost the job (exit 1); starting it again in 2 s (restart 2)",
    ]
    assert sorted(p.name for p in tmp_path.glob("run*")) == ["run1---rank-1-0", "run2---rank-1-1", "run3---rank-1-2"]


@pytest.mark.timeout(60)
def test_a_signal_to_the_keeper_stops_its_child_and_nothing_starts_again(tmp_path):
    program = """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))  # as train.py: stopped, saved
        open("started", "w").close()
        time.sleep(60)
    """
    code, err = signal_once_started(tmp_path, program, signal.SIGTERM)
    assert code == 3 and err == "", err


@pytest.mark.timeout(60)
def test_a_child_that_waited_for_its_job_in_vain_is_not_started_again(tmp_path):
    program = """
        import sys
        from utils.setup import keeper
        keeper.final()  # (train.py, after --rejoin-timeout passed without the job)
        sys.exit(1)
    """
    result = keep(tmp_path, program)
    assert result.returncode == 1 and result.stderr == "", result.stderr


# as train.py: nothing handles SIGUSR1 until stop.note_early(); one noted stops it after a step (exit 3)
STARTS_SLOWLY = """
    import sys, time
    open("started", "w").close()
    time.sleep(1.0)  # (train.py's imports)
    from utils.setup import stop
    stop.note_early()
    time.sleep(0.2)
    sys.exit(3 if stop.take_early() else 0)
"""


@pytest.mark.timeout(60)
def test_a_sigusr1_passed_on_while_the_child_starts_asks_it_to_stop_rather_than_ending_it(tmp_path):
    code, err = signal_once_started(tmp_path, STARTS_SLOWLY, signal.SIGUSR1)
    assert code == 3 and err == "", (code, err)  # (ended by it: 128 + 10)


@pytest.mark.timeout(60)
def test_a_sigusr1_to_the_keeper_before_its_handlers_reaches_its_child(tmp_path):
    early = "import os, signal\nfrom utils.setup import stop\nstop.note_early()\nos.kill(os.getpid(), signal.SIGUSR1)\n"
    result = keep(tmp_path, STARTS_SLOWLY, timeout=30, keeper=early + KEEP)
    assert result.returncode == 3 and result.stderr == "", (result.returncode, result.stderr)  # (dropped: 0)
