"""Faults on purpose, at a chosen step: how the tests and bench/recovery/recovery.py kill or freeze a rank
at a known moment (a real signal to a real process, sent by the rank to itself).

    RING_FAULT="1:25:KILL"              rank 1 gets SIGKILL as global step 25 begins (before its forward)
    RING_FAULT="0:25:STOP:sum,2:40:KILL" rank 0 gets SIGSTOP during step 25's gradient sum
                                        (after backward; overlapped sums are in flight), rank 2 ...

RANK is the rank in the job's first generation; STEP counts from the run's first step, over
epochs; PHASE is step (default), sum, save (as the checkpoint after that step is written),
join (as this member takes a joining server in, at the first growth from step STEP on), or
restart (as a keeper's restarted process begins, whatever STEP: utils/setup/keeper.py).
RING_EVENTS=PATH: each fault, and each rank's first completed step after a change of members
(utils/elastic/recovery.py), is appended there as a JSON line with its time (bench/recovery/recovery.py reads it).

Each fault fires once per process; with RING_FAULT_ONCE=PATH, once per job (the first process to
fire creates PATH: a rank that torchrun restarts does not kill itself again). Without RING_FAULT
nothing here does anything.
"""

import json
import os
import signal
import time

from utils.setup import stop

_faults = None  # [(rank, step, signal, phase)] of this process, once parsed
_step = None


def _parse(me):
    found = []
    for part in filter(None, os.environ.get("RING_FAULT", "").split(",")):
        rank, step, name, *phase = part.split(":")
        if int(rank) == me:
            found.append((int(step), getattr(signal, "SIG" + name.upper()), (phase or ["step"])[0]))
    return found


_me = None


def setup(me):
    global _faults, _me
    _me = me
    _faults = _parse(me) if os.environ.get("RING_FAULT") else []


def read_events(path):
    """The events that log() appended to `path` so far (bench/ and tests/ read them while the ranks
    run: a line still being written is left out)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines() if line.endswith("}")]


def log(**event):
    """Append `event` (with the time and this rank) to RING_EVENTS, if set."""
    path = os.environ.get("RING_EVENTS")
    if path:
        line = json.dumps(dict(event, time=time.time(), rank=_me)) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def at_restart(rank):
    """A keeper (--restart) started this process again, as `rank`: a fault of phase restart fires now."""
    if os.environ.get("RING_RESTARTS"):
        setup(rank)
        point("restart")


def at_step(step):
    """Global step `step` begins."""
    global _step
    _step = step
    point("step")


def point(phase):
    if not _faults:
        return
    for fault in list(_faults):
        step, signum, where = fault
        if where == phase and (step == _step or phase == "join" and _step >= step or phase == "restart"):
            _faults.remove(fault)
            once = os.environ.get("RING_FAULT_ONCE")
            if once:
                try:
                    os.close(os.open(once, os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    continue
            log(event="fault", signal=signum.name, step=step, phase=phase)
            if signum in stop.SIGNALS:  # its stop rides with the next sum this rank starts, even under load
                stop.send_to_self(signum)
            else:
                os.kill(os.getpid(), signum)
