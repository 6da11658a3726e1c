"""Faults on purpose, at a chosen step: how the tests and bench/recovery.py kill or freeze a rank
at a known moment (a real signal to a real process, sent by the rank to itself).

    RING_FAULT="1:25:KILL"              rank 1 gets SIGKILL as global step 25 begins (before its forward)
    RING_FAULT="0:25:STOP:sum,2:40:KILL" rank 0 gets SIGSTOP during step 25's gradient sum
                                        (after backward; overlapped sums are in flight), rank 2 ...

RANK is the rank in the job's first generation; STEP counts from the run's first step, over
epochs; PHASE is step (default), sum, or save (as the checkpoint after that step is written).
Each fault fires once per process; with RING_FAULT_ONCE=PATH, once per job (the first process to
fire creates PATH: a rank that torchrun restarts does not kill itself again). Without RING_FAULT
nothing here does anything.
"""
import os
import signal

_faults = None     # [(rank, step, signal, phase)] of this process, once parsed
_step = None


def _parse(me):
    found = []
    for part in filter(None, os.environ.get("RING_FAULT", "").split(",")):
        rank, step, name, *phase = part.split(":")
        if int(rank) == me:
            found.append((int(step), getattr(signal, "SIG" + name.upper()), (phase or ["step"])[0]))
    return found


def setup(me):
    global _faults
    _faults = _parse(me) if os.environ.get("RING_FAULT") else []


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
        if step == _step and where == phase:
            _faults.remove(fault)
            once = os.environ.get("RING_FAULT_ONCE")
            if once:
                try:
                    os.close(os.open(once, os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    continue
            os.kill(os.getpid(), signum)
