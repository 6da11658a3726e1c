"""Instruments: fault injection and the benchmarks' event log, one object that does nothing unless a
test or benchmark turns it on. Whoever needs it is handed it; the training loop never names it.

    instruments = from_environ()       train.py, once: OFF unless RING_INSTRUMENTS is set
    instruments.bind(me)               this rank's id in the job, once it is known
    instruments.at_step(step, model)   global step `step` begins: a fault of phase "step" fires
    instruments.point(phase)           "sum", "save", "join": a fault of that phase fires
    instruments.at_restart(rank)       (a keeper restarted this process) a fault of phase "restart"
    instruments.log(event=..., ...)    one JSON line, with the time and this rank, in the events file

RING_INSTRUMENTS is a JSON object, each key optional:

    {"faults": "1:25:KILL,0:25:STOP:sum", "once": PATH, "events": PATH, "pace": SECONDS}

faults: RANK:STEP:SIGNAL[:PHASE], comma-separated. RANK is the rank in the job's first generation;
STEP counts from the run's first step, over epochs; PHASE is step (default: as the step begins,
before its forward), sum (after backward, overlapped sums in flight), save (as the checkpoint after
that step is written), join (as this member takes a joining server in, at the first growth from step
STEP on) or restart (as a keeper's restarted process begins, whatever STEP: utils/setup/keeper.py).
A real signal, sent by the rank to itself; or, for SIGNAL, a NaN in this rank's values in step
STEP (phase step only; `model` is what at_step is handed): NAN, its forward's output (so its loss
and its gradient); NANGRAD, one value of its gradient, its loss finite. Each fault fires once per
process; with "once", once per job (the first process to fire creates PATH: a rank that torchrun
restarts does not kill itself again).
events: each fault, and what the elastic code notes (a rank's first step after a change of members,
an agreement, a rejoin's ask) are appended there as JSON lines (bench/ and tests/ read them: read_events).
pace: seconds every rank sleeps as each step begins (a decimal number, as a string). A job that must
outlast a rejoin on the fastest machine lasts by the clock rather than by its images: the tests train
a third of the images they would need otherwise, and leave the CPU they do not use to the others.
"""

import json
import os
import signal
import time

from utils.errors import UsageError

VARIABLE = "RING_INSTRUMENTS"
SIGNALS_THAT_STOP = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # (utils/setup/stop.py's)
NANS = ("NAN", "NANGRAD")  # the faults that are not signals: a NaN in a step's values


class Instruments:
    """Turned off: every call does nothing. (Injected is the one a test or benchmark turns on.)"""

    enabled = False

    def bind(self, me):
        pass

    def log(self, **event):
        pass

    def at_step(self, step, model=None):
        pass

    def point(self, phase):
        pass

    def at_restart(self, rank):
        pass


OFF = Instruments()


class Injected(Instruments):
    """Instruments turned on by RING_INSTRUMENTS (see the module's docstring). send_to_self(signum):
    how a stop signal reaches this process (utils.setup.stop.send_to_self: it rides with the next
    sum this rank starts, even under load)."""

    enabled = True

    def __init__(self, faults="", once=None, events=None, send_to_self=None, pace=0.0):
        self.spec, self.once, self.events, self.pace = faults or "", once, events, pace
        self.send_to_self = send_to_self or (lambda signum: os.kill(os.getpid(), signum))
        self.me, self.faults, self.step, self.model = None, [], None, None

    def bind(self, me):
        self.me = me
        self.faults = parse(self.spec, me)

    def log(self, **event):
        if not self.events:
            return
        line = json.dumps(dict(event, time=time.time(), rank=self.me)) + "\n"
        fd = os.open(self.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def at_step(self, step, model=None):
        self.step, self.model = step, model
        if self.pace:
            time.sleep(self.pace)
        self.point("step")

    def at_restart(self, rank):
        self.bind(rank)
        self.point("restart")

    def point(self, phase):
        for fault in [f for f in self.faults if self._due(f, phase)]:
            self.faults.remove(fault)
            if self.once and not first_in_job(self.once):
                continue
            step, signum, _ = fault
            self.log(event="fault", signal=getattr(signum, "name", signum), step=step, phase=phase)
            if signum in NANS:
                nan_in(self.model, gradient_only=signum == "NANGRAD")
            elif signum in SIGNALS_THAT_STOP:
                self.send_to_self(signum)
            else:
                os.kill(os.getpid(), signum)

    def _due(self, fault, phase):
        step, _, where = fault
        if where != phase:
            return False
        return (
            phase == "restart" or step == self.step or (phase == "join" and self.step is not None and self.step >= step)
        )


PHASES = ("step", "sum", "save", "join", "restart")


def nan_in(model, gradient_only):
    """A NaN in this step of `model`: its output (so the loss and every gradient), or one value of its
    first parameter's gradient (the loss stays finite); once, by a hook that takes itself away."""
    nan = float("nan")

    def output(module, inputs, out):
        hook.remove()
        return out * nan

    def gradient(grad):
        hook.remove()
        grad = grad.clone()
        grad.view(-1)[0] = nan
        return grad

    if gradient_only:
        hook = next(model.parameters()).register_hook(gradient)
    else:
        hook = model.register_forward_hook(output)


def parse(spec, me):
    """[(step, signal, phase)] of rank `me` (None: every rank's, to check them) in a faults spec
    ("1:25:KILL,0:25:STOP:sum"); ValueError if a part is not RANK:STEP:SIGNAL[:PHASE]."""
    found = []
    for part in filter(None, spec.split(",")):
        rank, step, name, *phase = part.split(":")
        rank, step = int(rank), int(step)
        signum, phase = getattr(signal, "SIG" + name.upper(), None), (phase or ["step"])[0]
        if name.upper() in NANS and phase == "step":
            signum = name.upper()
        if signum is None or phase not in PHASES:
            raise ValueError(f"{part!r} is not RANK:STEP:SIGNAL[:{'|'.join(PHASES)}]")
        if me is None or rank == me:
            found.append((step, signum, phase))
    return found


def first_in_job(path):
    """Whether this process is the first of the job to fire a fault (it creates `path`)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def from_environ(environ=os.environ, send_to_self=None):
    """OFF, or the Injected instruments that RING_INSTRUMENTS asks for; a malformed value is one
    UsageError line."""
    text = environ.get(VARIABLE)
    if not text:
        return OFF
    try:
        settings = json.loads(text)
        if not isinstance(settings, dict) or set(settings) - {"faults", "once", "events", "pace"}:
            raise ValueError("expected an object of faults, once, events and pace")
        if not all(v is None or isinstance(v, str) for v in settings.values()):
            raise ValueError("each value a string")
        parse(settings.get("faults") or "", None)
        pace = float(settings.get("pace") or 0)
        if not 0 <= pace <= 10:
            raise ValueError("pace: seconds from 0 to 10")
    except (ValueError, AttributeError) as e:
        raise UsageError(f"{VARIABLE} is malformed ({e}): {text[:200]!r}") from None
    faults, once, events = settings.get("faults") or "", settings.get("once"), settings.get("events")
    return Injected(faults, once, events, send_to_self, pace)


def environ_for(faults=None, once=None, events=None, pace=None):
    """{RING_INSTRUMENTS: ...} for a test's or a benchmark's environment (pace: seconds, a number)."""
    pace = None if pace is None else str(pace)
    settings = {k: v for k, v in (("faults", faults), ("once", once), ("events", events), ("pace", pace)) if v}
    return {VARIABLE: json.dumps(settings)}


def read_events(path):
    """The events that log() appended to `path` so far (bench/ and tests/ read them while the ranks
    run: a line still being written is left out)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines() if line.endswith("}")]
