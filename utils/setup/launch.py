"""Starting the ranks of a job and watching them: the local launcher, and one supervisor for all.

    launch_local(script, argv, nproc)   `python train.py` with no --rank: every rank here, over loopback
    supervise(procs, timeout, grace)    wait for one job's processes; stop them all when one fails

supervise is the one process supervisor: the local launcher, scripts/cluster.py, the benchmarks
and the tests use it. Distributed code hangs when it fails, so a job's processes are watched
together: once one fails, the others get `grace` seconds to say what they saw, then they are
killed; at `timeout` every one is killed; and whatever is still running when supervise returns,
or is interrupted, is killed (its whole process group, if it leads one).
"""

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from utils.errors import EXIT_BAD_INPUT, EXIT_NOT_FINITE, EXIT_STOPPED
from utils.setup import fork, stop
from utils.setup.handoff import Handoff
from utils.setup.threads import cpus_here, share, users_choice

GRACE_SECONDS = 5.0
POLL_SECONDS = 0.2
LOWEST_PORT = 10000  # free_port's draws: from here to the kernel's ephemeral range


@dataclass
class Outcome:
    """What supervise saw of one job."""

    codes: list  # each process's exit code (None: killed at the timeout, still unreaped)
    failed: int = 0  # the first non-zero exit code, 0 if none
    timed_out: bool = False
    killed: bool = False  # some were still running when supervise stopped them
    outputs: list | None = None  # [(stdout, stderr)] of processes started with pipes, else None


def supervise(procs, timeout=None, grace=GRACE_SECONDS, poll=POLL_SECONDS, ok_codes=(0,), while_running=None):
    """Wait for every process of `procs`; see the module's docstring. Pipes (stdout/stderr=PIPE)
    are read as they fill, so a chatty process never blocks on a full pipe. An exit code outside
    `ok_codes` is a failure; grace=None: a failure stops nobody (each process ends by itself or at
    the timeout). while_running(procs), if given, is called every `poll` seconds."""
    readers = [collect(p) for p in procs]
    leaders = [leads_group(p) for p in procs]
    deadline = time.monotonic() + timeout if timeout is not None else None
    failed, grace_ends, timed_out = 0, None, False
    try:
        while any([p.poll() is None for p in procs]):  # a list: poll every one, each round
            if not failed:
                failed = next((p.returncode for p in procs if p.returncode not in (None, *ok_codes)), 0)
                if failed and grace is not None:  # the job is lost: the others say what they saw, then stop
                    grace_ends = time.monotonic() + grace
            now = time.monotonic()
            if grace_ends is not None and now > grace_ends:
                break
            if deadline is not None and now > deadline:
                timed_out = True
                break
            if while_running is not None:
                while_running(procs)
            time.sleep(poll)
    finally:
        killed = any([p.poll() is None for p in procs])
        for p, leader in zip(procs, leaders):
            kill(p, leader)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # stuck in the kernel: SIGKILLed, it goes when it can
            pass
    outputs = [reader() for reader in readers] if any(p.stdout or p.stderr for p in procs) else None
    failed = failed or next((p.returncode for p in procs if p.returncode not in ok_codes), 0)
    return Outcome([p.returncode for p in procs], failed, timed_out, killed, outputs)


def collect(proc):
    """Read proc's pipes in threads; returns a function giving (stdout, stderr) once it has ended."""
    parts, threads = {}, []
    for name in ("stdout", "stderr"):
        stream = getattr(proc, name)
        if stream is not None:
            thread = threading.Thread(target=lambda s=stream, n=name: parts.__setitem__(n, s.read()), daemon=True)
            thread.start()
            threads.append(thread)

    def result():
        for thread in threads:
            thread.join()
        return parts.get("stdout"), parts.get("stderr")

    return result


def leads_group(proc):
    if proc.pid is None:  # (a rank on another server: utils/setup/remote.py)
        return False
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False


def kill(proc, group=None):
    """SIGKILL a process and, if it leads a process group (group=None: look now), the whole group,
    even once it has exited itself: what it started may still be running."""
    if group is None:
        group = proc.returncode is None and leads_group(proc)
    if group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if proc.poll() is None:
        proc.kill()


def free_port():
    """A TCP port of 127.0.0.1 that is free now, for a job's store to bind. Drawn at random below
    the kernel's ephemeral range: a port from bind(0) comes from that range, and once released
    the kernel may give it to any other socket before the store binds it (gloo's listeners and
    every outgoing connection take theirs from there), which failed a job now and then when many
    started on one machine."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    draw = random.SystemRandom()  # (not the random module's state: a seeded process would repeat it)
    draws = 100 if ephemeral > 2 * LOWEST_PORT else 0  # (a range that starts low: bind(0), as before)
    for _ in range(draws):
        port = draw.randrange(LOWEST_PORT, ephemeral)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_interface():
    return next((n for _, n in socket.if_nameindex() if n.startswith("lo")), "lo")


def die_with_parent():
    """In a child: get SIGTERM if the launcher dies, even by SIGKILL (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def stragglers_stopped(grace):
    """For supervise's while_running: once a rank has finished (exit 0, the job is done), kill the
    ranks still running `grace` seconds later (a frozen rank the job went on without)."""
    finished = []

    def check(procs):
        if not finished and any(p.poll() == 0 for p in procs):
            finished.append(time.monotonic())
        if finished and time.monotonic() - finished[0] > grace:
            for p in procs:
                if p.poll() is None:
                    kill(p)

    return check


def rank_threads(nproc, handoff):
    """The OMP_NUM_THREADS of the local launcher's `nproc` ranks: the user's, or their share of this
    machine's CPUs (utils/setup/threads.py's rule); and `handoff`, saying the launcher chose it if it did."""
    users = users_choice(os.environ, handoff)
    if users is not None:
        return users, handoff
    return str(share(len(cpus_here()), nproc)), handoff.replace(threads_from_launcher=True)


def rank_flags(rank, world_size, port, interface):
    return [
        "--rank",
        str(rank),
        "--world-size",
        str(world_size),
        "--init-method",
        f"tcp://127.0.0.1:{port}",
        "--gloo_socket_ifname",
        interface,
    ]


def launch_local(script, argv, nproc, prog="train.py", handoff=None, keep_going=False, fork_ranks=True):
    """Start `nproc` ranks of `script argv` over loopback and wait for all of them; the exit code.
    handoff: what this launcher hands its ranks (utils/setup/handoff.py: its resume command, say);
    they learn too that they are its ranks, not servers' commands, and that its pid stands for the job.
    keep_going: a rank that dies does not stop the others (they go on without it, --recover);
    the job then succeeds if every rank that ended by itself succeeded. fork_ranks=False: this
    process has run torch (a fork after OpenMP has run threads is not safe): start them afresh."""
    port, lo = free_port(), loopback_interface()
    count, handoff = rank_threads(nproc, handoff or Handoff())
    print(f"running {nproc} ranks on this machine over {lo} (127.0.0.1:{port}), {count} thread(s) each", flush=True)
    handoff = handoff.replace(job_pid=os.getpid(), launched_locally=True)
    env = dict(handoff.environ(os.environ), OMP_NUM_THREADS=count, PYTHONUNBUFFERED="1")
    loaded = fork.preload() if fork_ranks else None  # (before any thread)
    procs = []
    try:
        for r in range(nproc):
            procs.append(start_rank(script, [*argv, *rank_flags(r, nproc, port, lo)], env, r, loaded))
        stop.install(prog)  # SIGTERM/SIGINT to the launcher go on to its ranks, which stop after a step, saved
        stop.forward_to(procs)
        outcome = supervise(
            procs,
            grace=None if keep_going else GRACE_SECONDS,
            while_running=stragglers_stopped(GRACE_SECONDS) if keep_going else None,
        )
    finally:
        for p in procs:
            kill(p)
    return exit_code(outcome, keep_going, prog)


def start_rank(script, argv, env, rank, loaded):
    """One rank: a fork of this launcher once it has loaded torch (loaded: fork.preload's; see
    utils/setup/fork.py), so that it starts in a moment instead of loading torch; exec'd afresh when a
    variable torch reads at load is set otherwise, or loaded is None."""
    if loaded and fork.forkable(env, loaded.env):
        pid = fork.start(loaded, script, argv, env, die_with_parent=signal.SIGTERM, name=f"rank {rank}")
        return fork.Child(pid, [script, *argv])
    return subprocess.Popen([sys.executable, "-u", os.path.abspath(script), *argv], env=env, preexec_fn=die_with_parent)


def exit_code(outcome, keep_going, prog):
    """The launcher's exit code from what supervise saw, and the line that explains it if none did."""
    lost = [r for r, code in enumerate(outcome.codes) if code is not None and code < 0]
    said = next((code for code in outcome.codes if code is not None and code > 0), 0)  # a rank's own exit code
    if keep_going and lost and not said and 0 in outcome.codes:
        print(
            f"{prog}: the job finished without rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} "
            f"(killed by a signal)",
            file=sys.stderr,
        )
        return 0
    if said and lost:  # a rank was killed and the others said why they stopped: their code tells what happened
        return said
    if (
        outcome.failed and outcome.killed and outcome.failed not in (EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_NOT_FINITE)
    ):  # those were explained in one line
        print(f"{prog}: a rank failed (exit code {outcome.failed}); stopped the other ranks", file=sys.stderr)
    return outcome.failed
