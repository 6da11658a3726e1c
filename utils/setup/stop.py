"""Stopping like a production job: SIGTERM, SIGINT or SIGUSR1 stops the job after a step, a second signal at once;
train.py --stop from another terminal stops it as a first signal does.

    stop.note_early()      first thing: a SIGUSR1 before install() is kept for it
    stop.take_early()      those kept, for the keeper (--restart), which passes them on to its child
    stop.install(label)    in a rank, before anything slow: from now on signals are handled here
    stop.arm()             training has begun: a first signal now only asks for a stop
    stop.request(reason)   a stop asked for without a signal (train.py --stop): as a first signal
    stop.signalled()       the first signal's name ("SIGTERM", "SIGINT", "SIGUSR1") or request's reason, or None
    stop.leaving()         the stop is done and this rank exits: signals from now on change nothing
    stop.forward_to(procs) in the local launcher: pass every signal on to its ranks
    stop.send_to_self(sig) a signal to this rank, returning once it has been dealt with (utils/observe/instruments.py)

SIGUSR1 is what `sbatch --signal=USR1@90` sends before a time limit: it stops as SIGTERM does, and
under Slurm rank 0 then requeues the job (utils/setup/slurm.py). As a warning, with time left, it does
not end a rank that is still starting: that one stops after its first step.

Before arm() there is nothing to save, so a signal ends the rank at once. After it, the first
signal is only noted: the trainer sends the note along with the next gradient sum (utils/run.py),
so every rank learns of it at the same step, and all stop there once rank 0 has saved. A second
signal ends the rank at once; a save it cuts short leaves the previous checkpoint whole (saves are
atomic). A repeat within REPEAT_SECONDS counts as the same request: a terminal's Ctrl-C, or a kill
of a whole process group or cgroup, reaches a rank twice, directly and through its launcher.

Python runs signal handlers only in the main thread, between bytecodes, so a rank blocked in a
gloo wait would not run one until the wait ends. Here the C-level handler writes the signal's
number to a pipe (signal.set_wakeup_fd), and a thread of ours reads it at once. The Python-level
handler does nothing: no KeyboardInterrupt tears through a save or a gradient sum.
"""

import os
import signal
import threading
import time

from utils.store import outputs

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
REPEAT_SECONDS = 1.0

_label = "train.py"
_armed = False
_first = None  # (signal name, monotonic time) of the first signal
_forward = None  # the launcher's ranks
_leaving = False
_dealt_with = threading.Event()  # the watch thread has dealt with a signal (send_to_self waits for it)
_early = []  # SIGUSR1s that came before install(): dealt with as it begins


def note_early():
    """Until install(), a SIGUSR1 is noted, not fatal: `sbatch --signal=USR1@N` sends it as soon as
    N seconds are left, which with a short --time is while the ranks are still starting. A keeper
    starts its child with SIGUSR1 blocked (utils/setup/keeper.py), and scripts/slurm.sbatch its
    tasks: one that came meanwhile comes now."""
    signal.signal(signal.SIGUSR1, lambda signum, _: _early.append(signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR1])


def take_early():
    """The SIGUSR1s noted so far, for a process that handles them itself (the keeper); none from now on."""
    taken = list(_early)
    _early.clear()
    return taken


def install(label):
    """Handle SIGNALS here from now on; `label` starts the line a signal prints."""
    global _label
    _label = label
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    for signum in SIGNALS:
        signal.signal(signum, lambda *_: None)  # the watch thread does the work
    threading.Thread(target=_watch, args=(read,), name="signal-watch", daemon=True).start()
    os.write(write, bytes(_early))  # (the watch thread deals with them as with any signal)
    _early.clear()


def arm():
    global _armed
    _armed = True


def leaving():
    global _leaving
    _leaving = True


def signalled():
    return _first[0] if _first else None


def request(reason):
    """A stop asked for without a signal (train.py --stop, through utils/elastic/detector.py): noted
    as a first signal is, so it rides with the next sum and the job stops after that step, saved;
    `reason` ("train.py --stop from HOST") names it in the rank's last line. Before arm(), as a
    SIGUSR1: the first step stops. Only the first request counts: a repeat changes nothing (a
    signal a second or more after it is a second signal, which stops at once)."""
    global _first
    if _first is None and not _leaving and _forward is None:
        _first = (reason, time.monotonic())


def forward_to(procs):
    global _forward
    _forward = list(procs)


def send_to_self(sig, timeout=5.0):
    """Send `sig` to this process and return once the watch thread has dealt with it (or after
    `timeout`): a stop then rides with the next sum the main thread starts, not, when the watch
    thread runs late under load, with the one after."""
    _dealt_with.clear()
    os.kill(os.getpid(), sig)
    _dealt_with.wait(timeout)


def _watch(fd):
    while True:
        for signum in os.read(fd, 64):
            _received(signal.Signals(signum))
            _dealt_with.set()


def _received(sig):
    global _first
    if _forward is not None:  # the launcher: its ranks decide what a signal means
        for proc in _forward:
            if proc.poll() is None:
                proc.send_signal(sig)
        return
    if _leaving:
        return
    if not _armed and sig != signal.SIGUSR1:  # a warning, not a request to end: the first step stops
        _exit(f"stopped by {sig.name} before training began; nothing to save", 128 + sig)
    now = time.monotonic()
    if _first is None:
        _first = (sig.name, now)
    elif now - _first[1] >= REPEAT_SECONDS:
        _exit(
            f"second signal ({sig.name}): stopped at once, without saving this step; the checkpoint "
            f"saved before stays whole",
            128 + sig,
        )


def _exit(message, code):
    os.write(2, f"{_label}: {message}\n".encode())  # not print: the main thread may hold sys.stderr's lock
    outputs.release()  # rank 0's lock files: a job stopped at once leaves none behind either
    os._exit(code)
