"""A script forked from a process that has loaded torch (utils/setup/fork.py, through tests/support/forker.py)
runs as it would started afresh: same arguments, folder, environment, threads, streams, session,
open files and exit code."""

import json
import os
import signal
import subprocess
import sys

import forker
import pytest
from forkserver import Forked

from utils.setup import fork

REPORT = """
import json, os, sys, torch
import sys as interpreter
print(json.dumps({
    "argv": sys.argv[1:], "cwd": os.getcwd(), "colour": os.environ.get("COLOUR"), "path0": interpreter.path[0],
    "threads": torch.get_num_threads(), "files": sorted(int(fd) for fd in os.listdir("/proc/self/fd"))[:3],
    "session_leader": os.getsid(0) == os.getpid(), "main": __name__, "fresh": "utils.setup.fork" not in sys.modules,
}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def started(argv, **kw):
    proc = forker.popen(argv, **kw)
    out, err = proc.communicate(timeout=60)
    return proc, out, err


def test_a_forked_script_sees_what_a_fresh_one_sees(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    argv = [sys.executable, str(script), "3", "two words"]
    kw = dict(
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        start_new_session=True,
        env=dict(os.environ, COLOUR="blue", OMP_NUM_THREADS="2"),
    )
    forked, out, err = started(argv, **kw)
    assert isinstance(forked, Forked)  # really forked, not exec'd
    fresh = subprocess.run(argv, **kw, timeout=60)
    assert forked.returncode == fresh.returncode == 3
    assert json.loads(out) == json.loads(fresh.stdout)
    assert json.loads(out)["threads"] == 2 and json.loads(out)["session_leader"]
    assert err == fresh.stderr == "to stderr\n"


def test_exit_codes_signals_and_exceptions_come_back(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import sys, time\nif sys.argv[1] == 'raise':\n    raise ValueError('no')\ntime.sleep(60)\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    failed, _, err = started([sys.executable, str(script), "raise"], env=env, stderr=subprocess.PIPE, text=True)
    assert failed.returncode == 1 and "ValueError: no" in err
    sleeper = forker.popen([sys.executable, str(script), "sleep"], env=env, start_new_session=True)
    assert isinstance(sleeper, Forked)
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.2)
    os.killpg(sleeper.pid, signal.SIGTERM)  # its own process group
    assert sleeper.wait(timeout=30) == -signal.SIGTERM
    sleeper.kill()  # ended: nothing to kill, nothing raised


def test_what_torch_reads_at_load_must_match():
    loaded = {"TORCH_CPP_LOG_LEVEL": "FATAL", "OMP_NUM_THREADS": "1", "PATH": "/bin", "PYTHONPATH": "/a"}
    assert fork.forkable({"TORCH_CPP_LOG_LEVEL": "FATAL", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/b"}, loaded)
    assert not fork.forkable({"TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}, loaded)
    assert not fork.forkable({"TORCH_CPP_LOG_LEVEL": "FATAL", "OMP_NUM_THREADS": "2"}, loaded)  # gloo's threads
    assert not fork.forkable({"TORCH_CPP_LOG_LEVEL": "FATAL"}, loaded)
    assert not fork.forkable({"TORCH_CPP_LOG_LEVEL": "FATAL", "OMP_NUM_THREADS": "1", "MKL_CBWR": "AVX2"}, loaded)
    assert not fork.forkable({}, None)  # torch loaded, nobody knows with what


def test_other_programs_are_started_as_before():
    for argv in ([sys.executable, "-c", "pass"], ["true"]):
        proc = forker.popen(argv)
        assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=30) == 0


def test_a_signal_in_the_moment_between_the_servers_reap_and_its_word_is_no_error():
    # The server reaps a child before it writes the exit code, so for a moment poll() says running
    # while the pid is gone. CI once saw kill() raise ProcessLookupError there.
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now
    status_read, status_write = os.pipe()
    child = Forked.__new__(Forked)
    child.pid, child.args, child.returncode, child._status = gone.pid, ["true"], None, status_read
    assert child.poll() is None  # no word from the server yet
    child.kill()
    child.terminate()
    os.write(status_write, b"0")
    os.close(status_write)
    assert child.poll() == 0
