"""Starting real processes from tests, with a hard timeout that kills them all; reading what they left.

`popen` is subprocess.Popen, but a `python SCRIPT` is forked from a process that has loaded torch
(tests/support/forker.py): the suite's processes would otherwise spend most of its time loading torch."""

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from checkpoint_watch import Watch
from forker import popen

from utils.setup.launch import free_port, kill, supervise  # noqa: F401  (free_port: for the tests)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "train.py")


def kill_group(proc):
    """SIGKILL proc's whole process group (every test starts its processes in sessions of their own)."""
    kill(proc, group=True)


def scratch_dir():
    """A fresh working folder, so train.py's default runs/ never lands in the repository; removed
    when the test session ends (each holds a few MB of checkpoints)."""
    folder = tempfile.mkdtemp(prefix="mnist-ring-test-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def run(argv, timeout, cwd=None, env=None):
    """Run argv in its own process group; on timeout kill the whole group and fail."""
    proc = popen(
        argv,
        cwd=cwd or scratch_dir(),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    outcome = supervise([proc], timeout=timeout, poll=0.05)  # kills the group on the way out, whatever happens
    out, err = outcome.outputs[0]
    if outcome.timed_out:
        raise AssertionError(f"{argv} did not finish within {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def train(args, timeout=300, cwd=None, env=None):
    """python train.py ARGS (the local launcher unless ARGS name a rank)."""
    return run([sys.executable, TRAIN, *args], timeout, cwd=cwd, env=env)


def start_ranks(world_size, args, port=None, cwd=None, env=None):
    """Start every rank of a loopback job as its own process (in `cwd`, default a fresh folder,
    with `env` laid over os.environ); returns the Popen list."""
    port, cwd = port or free_port(), cwd or scratch_dir()
    return [start_rank(r, world_size, args, port, cwd, env) for r in range(world_size)]


def start_rank(rank, world_size, args, port, cwd, env=None):
    """One rank of a loopback job on `port` (a server that joins: `args` end with --join), 1
    thread, its own session, its output piped."""
    return popen(
        [sys.executable, TRAIN, "--rank", str(rank), "--world-size", str(world_size)]
        + ["--init-method", f"tcp://127.0.0.1:{port}", "--gloo_socket_ifname", "lo", *args],
        env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
        cwd=str(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_all(procs, timeout):
    """Wait for every process (a failed one stops nobody); kill all at the deadline and fail.
    Returns [(returncode, stdout, stderr)]."""
    outcome = supervise(procs, timeout=timeout, grace=None, poll=0.05)
    if outcome.timed_out:
        out, err = next(
            ((o, e) for p, (o, e) in zip(procs, outcome.outputs) if p.returncode is None or p.returncode < 0),
            outcome.outputs[0],
        )
        raise AssertionError(f"a rank did not finish within {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outcome.outputs)]


def run_workers(worker, world_size, tmp_path, extra=(), env=None, timeout=200):
    """Run `worker RANK WORLD_SIZE PORT OUT *extra` for every rank (one gloo job over loopback);
    each must exit 0. Returns what each rank saved to its OUT, in rank order."""
    port = free_port()
    outs = [tmp_path / f"rank{r}.pt" for r in range(world_size)]
    ranks = [
        popen(
            [sys.executable, worker, str(r), str(world_size), str(port), str(outs[r]), *extra],
            env=env(r) if env else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(world_size)
    ]
    try:
        for code, _, err in wait_all(ranks, timeout=timeout):
            assert code == 0, err
    finally:
        for p in ranks:
            kill_group(p)
    return [torch.load(o, weights_only=True) for o in outs]


def wait_for(predicate, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


_watches = {}  # path -> checkpoint_watch.Watch: a file read again only when a save replaced it


def checkpoint_position(path):
    """(epoch, step) of the checkpoint at `path` now, or None; cheap enough to poll."""
    return _watches.setdefault(str(path), Watch(path)).position()


def stat(pid):
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses):
    [0] the state (R, S, T, Z, ...), [1] the parent's pid, [11] and [12] user and system CPU ticks."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def stopped_rank(launcher, rank):
    """The pid of `rank` among `launcher`'s children (its ranks, not every process on the machine)
    once a signal has stopped it (SIGSTOP: state T), else None."""
    try:
        tasks = os.listdir(f"/proc/{launcher.pid}/task")
        ranks = [pid for t in tasks for pid in open(f"/proc/{launcher.pid}/task/{t}/children").read().split()]
    except OSError:
        return None
    for pid in ranks:
        try:
            cmd = open(f"/proc/{pid}/cmdline").read().split("\0")
            name = open(f"/proc/{pid}/comm").read().strip()  # a rank the launcher forked
            state = stat(pid)[0]
        except OSError:
            continue
        given = "--rank" in cmd and cmd[cmd.index("--rank") + 1] == str(rank)
        if (name == f"rank {rank}" or given) and state == "T":
            return int(pid)
    return None


def final_digest(stdout):
    match = re.search(r"sha256 ([0-9a-f]{64})", stdout)
    assert match, stdout
    return match.group(1)
