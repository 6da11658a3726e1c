"""The gradient sum in buckets: PlainSync (--no-overlap) and OverlappedSync (--overlap).

Why this long: PlainSync and OverlappedSync share the bucket machinery; apart they would repeat it.

The parameters are summed in buckets, each with an all-reduce of its own (utils/comm/allreduce.py);
a compressor (utils/comm/compress.py), if one is asked for, decides what travels:

    PlainSync       one bucket, in the model's order, summed after backward.
    OverlappedSync  buckets in backward's order; as soon as a bucket's gradients are all there,
                    it is summed while autograd computes the earlier layers:

        main thread:      backward fc2 fc1 | conv2 ....... conv1 | wait | optimizer.step()
        bucket 0 thread:                   | sum fc* (1.6 MB) ...........|
        bucket 1 thread:                                         | sum conv* (75 KB)

                    Our rings are Python code: a thread per bucket runs them. gloo's sum needs
                    no thread of ours (its all_reduce is asynchronous, as DDP uses it) unless
                    something is compressed; its buckets then share one group, started in
                    bucket order on every rank. Our rings get a group per bucket, so the small
                    conv bucket, ready last, does not queue behind the big one on one socket.

LazySync (utils/sync/lazy.py) is an OverlappedSync that does not wait after backward.
The stop flag (utils/setup/stop.py) rides in the last bucket (the first layer's: summed last, needed
first by the next forward), as one more value summed exactly.
"""

import threading
import time

import torch

from utils.comm.allreduce import beside
from utils.errors import PeerError, first_line
from utils.sync.interface import GradientSync, wait_for, waited_since
from utils.timeline import OFF, TRAINING_ROW


def average_gradients(params, sum_, compressor, bucket=0, weight=1.0, flag=None, timeline=OFF):
    """Replace every rank's gradients of `params` by their average over all ranks, as one flat
    buffer (each hop of the ring is one message). sum_: an all-reduce; compressor: what travels;
    bucket: which of the compressor's buckets `params` are. Returns the flags' sums (or None)."""
    with timeline.span("sum", bucket=bucket, compress=type(compressor).__name__):
        flat, numel = flat_buffer(params, weight, flag)
        sum_.weigh(weight)
        compressor.average_(flat, bucket, sum_, extras=flat.numel() - numel)  # (NoCompression: the plain average)
        set_gradients(params, flat[:numel])
    return None if flag is None else flat[numel:].tolist()


def flat_buffer(params, weight=1.0, flag=None):
    """(one buffer of the gradients of `params` times `weight`, then the values of `flag` (a list)
    if given; the gradients' length).

    weight: this rank's share of the step's images times N, where the ranks' batches differ, so
    that the average over ranks weighs every image of the step alike (1.0 leaves the bits alone).
    """
    grads = [p.grad.reshape(-1) for p in params]
    if flag is None:
        flat = torch.cat(grads)
        numel = flat.numel()
    else:
        numel = sum(g.numel() for g in grads)
        flat = torch.empty(numel + len(flag))
        torch.cat(grads, out=flat[:numel])
        flat[numel:] = torch.tensor(flag)
    if weight != 1.0:
        flat[:numel].mul_(weight)
    return flat, numel


def set_gradients(params, flat):
    """Make each gradient its slice of `flat`: a view, since copying back would cost one more pass."""
    for p, part in zip(params, torch.split(flat, [p.numel() for p in params])):
        p.grad = part.view_as(p)


def make_buckets(params, bucket_bytes):
    """Group `params` (in backward order) into consecutive buckets of about bucket_bytes."""
    buckets, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class BucketSync(GradientSync):
    """What the bucketed kinds share: the buckets, their all-reduces, the flag in the last bucket."""

    def __init__(self, buckets, allreduces, compressor, optimizer, scheduler, timeline=OFF):
        super().__init__(optimizer, scheduler, compressor, timeline)
        self.buckets, self.allreduces = buckets, allreduces
        self.flag_bucket = len(buckets) - 1

    @property
    def has_rank_state(self):
        return self.compressor.compresses  # (PowerSGD's error buffers, fp16's scales)

    def stats(self):
        unique = list({id(a): a for a in self.allreduces}.values())  # gloo's buckets share one
        return dict(
            busy_seconds=self.busy_seconds,
            waited_seconds=self.waited_seconds,
            bytes_sent=sum(a.bytes_sent for a in unique),
            bytes_summed=sum(a.bytes_summed for a in unique),
        )

    def state_dict(self):
        """This rank's compression state (PowerSGD's error buffers differ between ranks)."""
        return self.compressor.state_dict()

    def load_state_dict(self, state):
        self.compressor.load_state_dict(state)

    def note(self):
        return self.allreduces[0].note()

    def abandon(self):
        self.close()
        return False

    def _average(self, i, weight, own_flags):
        flag = own_flags if i == self.flag_bucket else None
        summed = average_gradients(self.buckets[i], self.allreduces[i], self.compressor, i, weight, flag, self.timeline)
        if flag is not None:
            self.flag_sums = summed


class PlainSync(BucketSync):
    """backward first, then the whole sum, then the step.

    broken: as OverlappedSync's. None: the sum runs on the training thread. Otherwise on a thread of
    its own, which the training thread waits for (utils/sync/interface.py: given up ABANDON_SECONDS
    after the group broke); its spans are drawn on the training thread's row, whose work it is."""

    def __init__(self, *parts, broken=None, **named):
        super().__init__(*parts, **named)
        self.broken = broken

    def sum(self):
        start = time.perf_counter()
        try:
            if self.broken is None:
                self._average(0, self.weight, self.own_flags)
            else:
                self._average_on_a_thread()
        except RuntimeError as e:  # gloo reports a dead or silent peer this way
            raise PeerError(first_line(e)) from None  # train_model says where
        self.waited_seconds += waited_since(start)
        self.busy_seconds += time.perf_counter() - start

    def _average_on_a_thread(self):
        step = self.timeline.current_step() if self.timeline.recording else None

        def average():
            with self.timeline.drawn_in(step, row=TRAINING_ROW):
                self._average(0, self.weight, self.own_flags)

        work = beside(average, "plain-sum")
        wait_for(work.done, self.broken)
        work.wait()  # (raises what the sum raised)


class OverlappedSync(BucketSync):
    """Each bucket is summed as soon as backward has made all its gradients.

    broken: an Event set when this rank's group has broken (utils/elastic: a peer was lost and
    every connection cut), or None. A bucket's sum still running ABANDON_SECONDS after the group
    broke is given up (utils/sync/interface.py)."""

    overlaps = True

    def __init__(self, model, *parts, broken=None, **named):
        super().__init__(*parts, **named)
        self.broken = broken
        self.weights = [1.0] * len(self.buckets)  # the weight each bucket was started with
        self.flags_of = [None] * len(self.buckets)  # the flags it was started with (the flag bucket's)
        self.steps = [None] * len(self.buckets)  # the step it was started in, if the timeline recorded it
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.missing = [len(b) for b in self.buckets]  # gradients still to come, this step
        self.started = 0  # buckets 0..started-1 are being summed
        self.error, self.closed = None, False
        self.lock = threading.Lock()
        # gloo sums asynchronously on its own threads when nothing is compressed
        self.native = self.allreduces[0].native_async and not self.compressor.compresses
        if self.native:
            self.pending = [None] * len(self.buckets)  # (flat buffer, numel, work, started_ns, step)
        else:
            self.ready = [threading.Event() for _ in self.buckets]  # gradients there: sum it
            self.summed = [threading.Event() for _ in self.buckets]  # averaged (or failed)
            for i in range(len(self.buckets)):
                threading.Thread(target=self._communicate, args=(i,), name=f"gradient-sum-{i}", daemon=True).start()
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self.bucket_of]

    def _on_gradient(self, param):  # runs inside backward, once per parameter
        with self.lock:
            self.missing[self.bucket_of[param]] -= 1
            self._start_complete_buckets()

    def _start_complete_buckets(self):
        """Start each bucket whose gradients are all there, strictly in bucket order:
        collectives that share a group must be started in the same order on every rank."""
        while self.started < len(self.buckets) and self.missing[self.started] == 0:
            self._start(self.started)
            self.started += 1

    def _start(self, i):
        # a lazy step's bucket thread may run after the next step has begun: its weight is set by
        # then, and its spans would be drawn in that step (or left out of the timeline's window)
        self.weights[i], self.flags_of[i] = self.weight, self.own_flags
        self.steps[i] = self.timeline.current_step() if self.timeline.recording else None
        if self.timeline.recording:  # handed over, inside backward (its thread may start a moment later)
            now = self.timeline.now_ns()
            self.timeline.add("ready", now, now, bucket=i)
        if not self.native:
            self.ready[i].set()
            return
        flag = self.own_flags if i == self.flag_bucket else None
        flat, numel = flat_buffer(self.buckets[i], self.weight, flag)
        started_ns = self.timeline.now_ns()  # where the span starts, as its length is counted: from the sum's start
        work = self.allreduces[i].sum_async(flat)  # an error raised here, inside backward: wait_bucket reports it
        self.pending[i] = (flat, numel, work, started_ns, self.timeline.current_step())

    def _communicate(self, i):
        try:
            while True:
                self.ready[i].wait()
                self.ready[i].clear()
                if self.closed:
                    return
                start = time.perf_counter()
                with self.timeline.drawn_in(self.steps[i]):
                    self._average(i, self.weights[i], self.flags_of[i])
                with self.lock:
                    self.busy_seconds += time.perf_counter() - start
                self.summed[i].set()
        except Exception as e:  # a dead peer: hand the error to the training thread
            self.error = e
            for event in self.summed:
                event.set()

    def backward_done(self):
        """After loss.backward(): buckets whose parameters took no part are summed as zeros."""
        with self.lock:  # backward is over: every hook that was going to run has run
            for i, bucket in enumerate(self.buckets):
                if self.missing[i] > 0:
                    for p in bucket:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                    self.missing[i] = 0
            self._start_complete_buckets()
            self.missing = [len(b) for b in self.buckets]  # for the next step
            self.started = 0

    def wait_bucket(self, i):
        """Block until bucket i is averaged; raises PeerError if communication failed."""
        with self.timeline.span("wait", bucket=i):
            if not self.native:
                wait_for(self.summed[i], self.broken)
                if self.error is not None:
                    raise PeerError(first_line(self.error))  # the trainer says where
                self.summed[i].clear()
                return
            flat, numel, work, started_ns, step = self.pending[i]
            self.pending[i] = None
            try:
                wait_for(work.done, self.broken)
                work.wait()
            except RuntimeError as e:  # gloo reports a dead or silent peer this way
                raise PeerError(first_line(e)) from None
        seconds = (work.finished or time.perf_counter()) - work.started
        self.busy_seconds += seconds
        if step is not None:  # gloo's threads ran it: drawn on a row of its own
            self.timeline.add(
                "sum",
                started_ns,
                started_ns + int(seconds * 1e9),
                f"gloo-sum-{i}",
                bucket=i,
                step=step,
                algorithm="gloo",
                bytes=flat.numel() * flat.element_size(),
            )
        if i == self.flag_bucket:
            self.flag_sums = flat[numel:].tolist()
        set_gradients(self.buckets[i], flat[:numel].div_(self.allreduces[i].world_size))

    def sum(self):
        start = time.perf_counter()
        self.backward_done()
        for i in range(len(self.buckets)):
            self.wait_bucket(i)
        self.waited_seconds += waited_since(start)

    def close(self):
        for hook in self.hooks:
            hook.remove()
        self.closed = True  # (a sync replaced after a lost peer: its bucket threads end)
        for event in getattr(self, "ready", []):
            event.set()
