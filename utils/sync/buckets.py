"""The gradient-sync seam: what the training loop calls between backward and the next forward.

    sync = make_gradient_sync(model, config.sync, optimizer, scheduler, seed)
    sync.weigh(w); loss.backward(); sync.after_backward(); sync.step()
    sync.stop_count()   how many ranks had a signal when this step was summed (the same everywhere)
    sync.finish()       apply any update still due (before evaluating or saving)
    sync.stats()        communication time and bytes since the start
    sync.state_dict()   this rank's compression state, for the checkpoint

The parameters are summed in buckets, each with an all-reduce of its own (utils/comm/allreduce.py)
and compressed by one compressor (utils/comm/compress.py). Three ways, one class each:

    PlainSync       (--no-overlap) one bucket, in the model's order, summed after backward.
    OverlappedSync  (--overlap) buckets in backward's order; as soon as a bucket's gradients
                    are all there, it is summed while autograd computes the earlier layers:

        main thread:      backward fc2 fc1 | conv2 ....... conv1 | wait | optimizer.step()
        bucket 0 thread:                   | sum fc* (1.6 MB) ...........|
        bucket 1 thread:                                         | sum conv* (75 KB)

                    Our rings are Python code: a thread per bucket runs them. gloo's sum needs
                    no thread of ours (its all_reduce is asynchronous, as DDP uses it) unless
                    something is compressed; its buckets then share one group, started in
                    bucket order on every rank. Our rings get a group per bucket, so the small
                    conv bucket, ready last, does not queue behind the big one on one socket.
    LazySync        (--lazy-update) an OverlappedSync that does not wait after backward: each
                    bucket's update is applied just before the next forward first uses it
                    (utils/sync/lazy.py), so the sums also overlap the next forward.

The stop flag (utils/stop.py) rides in the last bucket (the first layer's: summed last, needed
first by the next forward), as one more value summed exactly.
"""

import datetime
import threading
import time

import torch

from utils import timeline
from utils.comm.allreduce import make_allreduce
from utils.comm.compress import NoCompression, make_compressor
from utils.errors import PeerError, first_line
from utils.sync.lazy import LazyUpdate


def average_gradients(params, sum_, compressor, bucket=0, weight=1.0, flag=None):
    """Replace every rank's gradients of `params` by their average over all ranks, as one flat
    buffer (each hop of the ring is one message). sum_: an all-reduce; compressor: what travels;
    bucket: which of the compressor's buckets `params` are. Returns the flag's sum (or None)."""
    with timeline.span("sum", bucket=bucket, compress=type(compressor).__name__):
        flat, numel = flat_buffer(params, weight, flag)
        compressor.average_(flat, bucket, sum_, extras=flat.numel() - numel)
        set_gradients(params, flat[:numel])
    return None if flag is None else flat[numel].item()


def flat_buffer(params, weight=1.0, flag=None):
    """(one buffer of the gradients of `params` times `weight`, then `flag` if given; the gradients' length).

    weight: this rank's share of the step's images times N, where the ranks' batches differ, so
    that the average over ranks weighs every image of the step alike (1.0 leaves the bits alone).
    """
    grads = [p.grad.reshape(-1) for p in params]
    if flag is None:
        flat = torch.cat(grads)
        numel = flat.numel()
    else:
        numel = sum(g.numel() for g in grads)
        flat = torch.empty(numel + 1)
        torch.cat(grads, out=flat[:numel])
        flat[numel] = flag
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


class GradientSync:
    """What every way of summing shares: the buckets, their all-reduces, the optimizer step."""

    def __init__(self, buckets, allreduces, compressor, optimizer, scheduler, local_flag=lambda: 0.0):
        self.buckets, self.allreduces, self.compressor = buckets, allreduces, compressor
        self.optimizer, self.scheduler = optimizer, scheduler
        self.local_flag = local_flag  # this rank's stop flag, read as the flag's bucket starts
        self.flag_bucket = len(buckets) - 1
        self.flag_sum = 0.0  # the flag summed over ranks, as of the last sum of it
        self.weight = 1.0  # this step's gradient weight (see flat_buffer)
        self.busy_seconds = 0.0  # communication ran this long, over all buckets
        self.waited_seconds = 0.0  # the training thread waited this long for it

    def weigh(self, weight):
        """This step's weight of this rank's gradient: its share of the step's images times N."""
        self.weight = weight

    def after_backward(self):
        raise NotImplementedError

    def step(self):
        """optimizer.step() and the learning-rate schedule."""
        with timeline.span("optimizer"):
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()

    def stop_count(self):
        return self.flag_sum

    def finish(self):
        pass

    def flush(self):
        """The end of training: nothing left to apply (utils/sync/periodic.py has more to do)."""
        self.finish()

    def stats(self):
        """{busy_seconds, waited_seconds, bytes_sent, bytes_summed} since the start."""
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

    def close(self):
        pass

    def abandon(self):
        """After a lost peer: whether the last step train_step returned from was left undone
        (lazy: its update was still being applied; what of it was applied is taken back)."""
        self.close()
        return False

    def _average(self, i, weight):
        flag = self.local_flag() if i == self.flag_bucket else None
        summed = average_gradients(self.buckets[i], self.allreduces[i], self.compressor, i, weight, flag)
        if flag is not None:
            self.flag_sum = summed


class PlainSync(GradientSync):
    """backward first, then the whole sum on the training thread, then the step."""

    def after_backward(self):
        start = time.perf_counter()
        try:
            self._average(0, self.weight)
        except RuntimeError as e:  # gloo reports a dead or silent peer this way
            raise PeerError(first_line(e)) from None  # train_model says where
        self.busy_seconds += time.perf_counter() - start
        self.waited_seconds += time.perf_counter() - start


class OverlappedSync(GradientSync):
    """Each bucket is summed as soon as backward has made all its gradients."""

    def __init__(self, model, *parts, **named):
        super().__init__(*parts, **named)
        self.weights = [1.0] * len(self.buckets)  # the weight each bucket was started with
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.missing = [len(b) for b in self.buckets]  # gradients still to come, this step
        self.started = 0  # buckets 0..started-1 are being summed
        self.error, self.closed = None, False
        self.lock = threading.Lock()
        # gloo sums asynchronously on its own threads when nothing is compressed
        self.native = self.allreduces[0].native_async and type(self.compressor) is NoCompression
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
        self.weights[i] = self.weight  # a lazy step's bucket thread may run after the next weight is set
        if timeline.recording():  # handed over, inside backward (its thread may start a moment later)
            now = timeline.now_ns()
            timeline.add("ready", now, now, bucket=i)
        if not self.native:
            self.ready[i].set()
            return
        flag = self.local_flag() if i == self.flag_bucket else None
        flat, numel = flat_buffer(self.buckets[i], self.weight, flag)
        started_ns = timeline.now_ns()  # where the span starts, as its length is counted: from the sum's start
        work = self.allreduces[i].sum_async(flat)  # an error raised here, inside backward: wait_bucket reports it
        self.pending[i] = (flat, numel, work, started_ns, timeline.current_step())

    def _communicate(self, i):
        try:
            while True:
                self.ready[i].wait()
                self.ready[i].clear()
                if self.closed:
                    return
                start = time.perf_counter()
                self._average(i, self.weights[i])
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
        with timeline.span("wait", bucket=i):
            if not self.native:
                self.summed[i].wait()
                if self.error is not None:
                    raise PeerError(first_line(self.error))  # the trainer says where
                self.summed[i].clear()
                return
            flat, numel, work, started_ns, step = self.pending[i]
            self.pending[i] = None
            try:
                work.wait()
            except RuntimeError as e:  # gloo reports a dead or silent peer this way
                raise PeerError(first_line(e)) from None
        seconds = (work.finished or time.perf_counter()) - work.started
        self.busy_seconds += seconds
        if step is not None:  # gloo's threads ran it: drawn on a row of its own
            timeline.add(
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
            self.flag_sum = flat[numel].item()
        set_gradients(self.buckets[i], flat[:numel].div_(self.allreduces[i].world_size))

    def after_backward(self):
        start = time.perf_counter()
        self.backward_done()
        for i in range(len(self.buckets)):
            self.wait_bucket(i)
        self.waited_seconds += time.perf_counter() - start

    def close(self):
        for hook in self.hooks:
            hook.remove()
        self.closed = True  # (a sync replaced after a lost peer: its bucket threads end)
        for event in getattr(self, "ready", []):
            event.set()


class LazySync(OverlappedSync):
    """Does not wait after backward; the next forward applies each bucket's update (utils/sync/lazy.py)."""

    def __init__(self, model, *parts, **named):
        super().__init__(model, *parts, **named)
        self.lazy = LazyUpdate(model, self.optimizer, self.scheduler, self)

    def after_backward(self):
        self.backward_done()

    def step(self):
        self.lazy.step()

    def stop_count(self):  # the flag's bucket: the next forward would wait for it first anyway
        self.lazy.apply(self.flag_bucket)
        return self.flag_sum

    def finish(self):
        self.lazy.finish()

    def stats(self):
        return dict(super().stats(), waited_seconds=self.waited_seconds + self.lazy.waited_seconds)

    def close(self):
        self.lazy.close()
        super().close()

    def abandon(self):
        self.close()
        return self.lazy.undo()


def make_gradient_sync(model, sync, optimizer, scheduler, seed=0, local_flag=lambda: 0.0):
    """The gradient sync of a utils.config.Sync for `model` (a collective: every rank makes it
    at the same point, since it makes the buckets' process groups)."""
    params = list(model.parameters())
    timeout = datetime.timedelta(seconds=sync.timeout)
    if sync.sync_every > 1:  # H local steps, then the parameters' change (utils/sync/periodic.py)
        from utils.sync.periodic import PeriodicSync

        try:
            allreduce = make_allreduce(sync.allreduce, sync.chunks, timeout, own_group=True)
        except RuntimeError as e:
            raise PeerError(f"lost a peer during start-up: {first_line(e)}") from None
        return PeriodicSync(
            model,
            allreduce,
            make_compressor(sync.compress, [params]),
            optimizer,
            scheduler,
            sync.sync_every,
            sync.outer,
            sync.outer_lr,
            sync.outer_momentum,
            local_flag,
            sync.merge_after,
        )
    buckets = make_buckets(list(reversed(params)), int(sync.bucket_mb * 2**20)) if sync.overlap else [params]
    compressor = make_compressor(sync.compress, buckets, sync.powersgd_rank, sync.powersgd_warmup, seed)
    try:
        first = make_allreduce(sync.allreduce, sync.chunks, timeout, own_group=sync.overlap)
        shared = first.native_async and type(compressor) is NoCompression  # see OverlappedSync
        allreduces = [first] + [
            first if shared else make_allreduce(sync.allreduce, sync.chunks, timeout, own_group=True)
            for _ in buckets[1:]
        ]
    except RuntimeError as e:
        raise PeerError(f"lost a peer during start-up: {first_line(e)}") from None
    parts = (buckets, allreduces, compressor, optimizer, scheduler, local_flag)
    if not sync.overlap:
        return PlainSync(*parts)
    return (LazySync if sync.lazy_update else OverlappedSync)(model, *parts)
