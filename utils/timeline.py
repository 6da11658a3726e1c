"""A timeline of every rank (--timeline PATH): where each step's time went, as a Chrome trace.

Each rank records spans while the steps of a window run (--timeline-steps A:B); after step B
every rank hands its spans to rank 0, which writes one trace-event JSON file that Perfetto UI
(ui.perfetto.dev) and chrome://tracing open. Every rank is a process of its own, with a row for
the training thread and a row per bucket's sum:

    rank 0  training   | forward | backward ........... | wait | optimizer | forward ...
            bucket 0            | sum fc* (1.6 MB) .............|
            bucket 1                              | sum conv* |
    rank 1  training   | forward | backward ............. | wait | optimizer | ...

Clocks: every rank times with its own monotonic clock, whose zero differs from server to
server. At start-up each rank measures its offset to rank 0 with a few round trips (the one
with the shortest round trip wins; half of it bounds the error) and shifts its spans onto rank
0's clock, so a straggler shows up as a straggler and not as clock skew. The trace's metadata
holds every rank's offset and error.

The run makes one Recorder and hands it to whoever draws on it (the gradient sync, its all-reduces,
recovery). Without --timeline they are handed `OFF`, whose `span` returns one shared do-nothing
context. Recording costs a few microseconds a span; there are about ten spans a step.
"""

import contextlib
import json
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from utils.errors import UsageError
from utils.exchange import all_gather_json
from utils.store.files import write_file

ROUND_TRIPS = 8  # per rank, to estimate its clock's offset to rank 0's
TRAINING_ROW = "MainThread"  # the training thread's row (its thread's name)
_NO_SPAN = contextlib.nullcontext()


class Off:
    """The timeline without --timeline: every call does nothing (a span is one shared do-nothing
    context). Whoever draws on the timeline is handed one of these or a Recorder."""

    recording = False  # True while the steps of the window run: callers skip work done only for the trace

    def span(self, name, **args):
        """`with timeline.span("forward"):` records the block on this thread's row, while recording.
        `with timeline.span(...) as args:` gives the span's args to add to (None when not recording)."""
        return _NO_SPAN

    def add(self, name, start_ns, end_ns, row=None, **args):
        """Record a span timed elsewhere (gloo's asynchronous sums), on `row` or this thread's."""

    def now_ns(self):
        return time.perf_counter_ns()

    def drawn_in(self, step, row=None):
        """`with timeline.drawn_in(step):` the spans this thread draws in the block are of `step`
        (None: none are drawn), whatever step is under way when they begin; on `row` if given
        (work done on the training thread's behalf), else on this thread's."""
        return _NO_SPAN

    def at_step(self, step):
        """Step `step` (counted over the whole run) begins."""

    def window_ends(self):
        """True after the window's last step: time to write(), once the step's sums are done."""
        return False

    def write(self):
        """Write the trace now if it is not yet written (a collective: every rank calls it alike)."""

    def current_step(self):
        """The step under way (None without --timeline): spans done later for it (a lazy update,
        gloo's sum, timed once waited for) name it in step=..."""
        return None


OFF = Off()


class Recorder(Off):
    """This rank's spans for steps first..last (counted from the run's first step, over epochs)."""

    def __init__(self, path, first, last, total_steps):
        self.path, self.first, self.last, self.total_steps = path, first, last, total_steps
        self.step, self.recording, self.written = 0, False, False
        self.spans = []  # (name, row, start_ns on rank 0's clock, end_ns, args)
        self.here = threading.local()  # .step, .row: drawn_in's, on a thread inside one
        # For tests only: TIMELINE_TEST_CLOCK_SKEW_S="0,5.5" sets rank r's clock off by the r-th number
        # of seconds, as another server's clock would be; the clock alignment must take it out.
        skews = os.environ.get("TIMELINE_TEST_CLOCK_SKEW_S", "0").split(",")
        self.skew_ns = int(float(skews[dist.get_rank() % len(skews)]) * 1e9)
        self.offset_ns, self.error_ns = align_clock(self.now_ns)

    def now_ns(self):
        return time.perf_counter_ns() + self.skew_ns

    def at_step(self, step):
        self.step = step
        self.recording = self.first <= step <= self.last and not self.written

    def window_ends(self):
        return self.recording and self.step == self.last

    def current_step(self):
        return self.step

    @contextlib.contextmanager
    def drawn_in(self, step, row=None):
        # a bucket's sum runs on a thread of its own, which may start after the next step began
        self.here.step, self.here.row = step, row
        try:
            yield
        finally:
            del self.here.step, self.here.row

    def _step_here(self):
        """The step this thread's spans are of now (None: not drawn)."""
        return getattr(self.here, "step", self.step) if self.recording else None

    def span(self, name, **args):
        return self._span(name, args) if self._step_here() is not None else _NO_SPAN

    @contextlib.contextmanager
    def _span(self, name, args):
        """Yields `args`, which the block may add to (what it learns on the way: bytes sent)."""
        args.setdefault("step", self._step_here())  # the step it began in, though it may end in the next
        start = self.now_ns()
        try:
            yield args
        finally:
            self._add(name, start, self.now_ns(), None, args)

    def add(self, name, start_ns, end_ns, row=None, **args):
        if self._step_here() is not None:
            self._add(name, start_ns, end_ns, row, args)

    def _add(self, name, start_ns, end_ns, row, args):
        args.setdefault("step", self._step_here())
        row = row or getattr(self.here, "row", None) or threading.current_thread().name
        self.spans.append((name, row, start_ns + self.offset_ns, end_ns + self.offset_ns, args))

    def write(self):
        """Every rank: hand the spans to rank 0, which writes the trace (a collective; once; as JSON,
        which the trace is anyway: a span's tuple comes back a list)."""
        if self.written:
            return
        self.recording, self.written = False, True
        mine = dict(
            rank=dist.get_rank(),
            host=socket.gethostname(),
            pid=os.getpid(),
            spans=self.spans,
            offset_ns=self.offset_ns,
            error_ns=self.error_ns,
        )
        everyone = all_gather_json(mine)
        if dist.get_rank() == 0:
            last = min(self.last, self.total_steps)
            what = f"steps {self.first}-{last}" if self.spans else f"nothing (no step of {self.first}-{last} ran)"
            try:
                write_file(self.path, json.dumps(chrome_trace(everyone, self.first, last, self.total_steps)).encode())
            except UsageError as e:  # a full disk, /dev/full: the trace is lost, the training goes on
                os.write(2, f"train.py: rank 0: could not write the timeline ({e}); training goes on\n".encode())
                return
            print(f"timeline of {what} written to {self.path}", flush=True)
        self.spans = []


def align_clock(now_ns):
    """(offset, error) in ns that put this rank's now_ns() on rank 0's clock (a collective).

    Rank 0 answers each other rank in turn: the rank sends, rank 0 replies with its clock t0; the
    rank, which sent at t1 and heard back at t2, puts t0 at (t1 + t2) / 2, off by at most half the
    round trip. The shortest of ROUND_TRIPS round trips gives the estimate.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    stamp = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        for other in range(1, n):
            for _ in range(ROUND_TRIPS):
                dist.recv(stamp, other)
                stamp[0] = now_ns()
                dist.send(stamp, other)
        return 0, 0
    best = None
    for _ in range(ROUND_TRIPS):
        sent = now_ns()
        dist.send(stamp, 0)
        dist.recv(stamp, 0)
        heard = now_ns()
        estimate = (stamp.item() - (sent + heard) // 2, (heard - sent + 1) // 2)
        if best is None or estimate[1] < best[1]:
            best = estimate
    return best


def chrome_trace(everyone, first, last, total_steps):
    """The trace-event JSON object: a process per rank, a thread row per recording thread."""
    events, origin = [], min((s[2] for r in everyone for s in r["spans"]), default=0)
    for r in everyone:
        pid = r["rank"]
        rows = sorted({s[1] for s in r["spans"]}, key=row_order)
        events.append(dict(ph="M", name="process_name", pid=pid, args=dict(name=f"rank {pid} ({r['host']})")))
        events.append(dict(ph="M", name="process_sort_index", pid=pid, args=dict(sort_index=pid)))
        for tid, row in enumerate(rows):
            events.append(dict(ph="M", name="thread_name", pid=pid, tid=tid, args=dict(name=row_label(row))))
            events.append(dict(ph="M", name="thread_sort_index", pid=pid, tid=tid, args=dict(sort_index=tid)))
        for name, row, start, end, args in r["spans"]:
            events.append(
                dict(
                    ph="X",
                    name=name,
                    cat=name.split()[0],
                    pid=pid,
                    tid=rows.index(row),
                    ts=(start - origin) / 1e3,
                    dur=(end - start) / 1e3,
                    args=args,
                )
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "window": f"steps {first} to {last} of {total_steps} (--timeline-steps); "
            f"the other steps are not in this file",
            "first_step": first,
            "last_step": last,
            "total_steps": total_steps,
            "world_size": len(everyone),
            "clock_offset_ns": [r["offset_ns"] for r in everyone],
            "clock_error_ns": [r["error_ns"] for r in everyone],
            "time_zero_ns_on_rank0_clock": origin,
        },
    }


def row_order(row):
    """The training thread first, then the buckets in order."""
    if row == TRAINING_ROW:
        return (0, 0, row)
    number = row.rsplit("-", 1)[-1]
    return (1, int(number) if number.isdigit() else 0, row)


def row_label(row):
    if row == TRAINING_ROW:
        return "training"
    if row.startswith("gradient-sum-"):
        return f"bucket {row.rsplit('-', 1)[-1]} sum"
    return row
