"""Summing gradients while backward is still running, and updating while forward runs.

backward() produces gradients from the last layer to the first. Instead of waiting for all of
them, the parameters are grouped into buckets in that order; as soon as a bucket's gradients
are all there, that bucket's own thread averages it over the ranks (with any algorithm of
utils/ring.py) while autograd keeps computing the earlier layers:

    main thread:      backward fc2 fc1 | conv2 ....... conv1 | wait() | optimizer.step()
    bucket 0 thread:                   | sum fc* (1.6 MB) ...........|
    bucket 1 thread:                                         | sum conv* (75 KB)

With --allreduce gloo no thread of ours is needed: the gradient hook starts gloo's asynchronous
all_reduce, which runs on gloo's own threads (as DDP does). That saves the Python thread's
wake-ups and 0.5-0.9 ms of CPU per rank and step, which counts when the ranks share cores.

With our rings every bucket has its own process group (its own TCP connections), so the small
conv bucket, ready last, does not queue behind the big fc bucket on one socket. Each bucket's
messages match up because each bucket is summed once per step, in its own group, on every rank.
The hierarchical sum gets its own subgroups per bucket (a utils.hierarchical.Hierarchy each).
gloo's buckets share one group; they are started in bucket order, the same on every rank.

Lazy update (LazyUpdate, --lazy-update) goes one step further: after backward the trainer does
not wait at all. Each bucket's optimizer update is applied just before the next forward first
uses its parameters. The next step's forward starts with conv1, whose small bucket is done
first, while the big fc bucket is still on the wire:

    main thread:   backward ... | forward: [step conv*] conv1 conv2 [step fc*] fc1 fc2 | backward
    bucket 0:      sum fc* ..........................................|
    bucket 1:              sum conv* |

Adam's update of a parameter reads only that parameter's gradient and state, so updating bucket
by bucket, with the step's learning rate, gives exactly the parameters of one optimizer.step().

The stop flag (utils/stop.py) rides in the last bucket, which holds the first layer: it is summed
last during backward, and the next forward waits for it first anyway, so learning it right after
the step (LazyUpdate.apply) costs no overlap.
"""
import threading
import time

import torch
import torch.distributed as dist

from utils import ring, timeline
from utils.compress import NoCompression, RingSum
from utils.errors import PeerError, first_line
from utils.hierarchical import Hierarchy


def average_gradients(params, sum_, compressor, bucket=0, weight=1.0, flag=None):
    """Replace every rank's gradients of `params` by their average over all ranks.

    The gradients travel as one flat buffer, so each hop of the ring is one message. sum_: a
    compress.RingSum (the ring and group); compressor: what travels (utils/compress.py);
    bucket: which of the compressor's buckets `params` are. weight and flag: see flat_buffer.
    Returns the flag's sum over all ranks (None without a flag).
    """
    with timeline.span("sum", bucket=bucket, compress=type(compressor).__name__):
        flat, numel = flat_buffer(params, weight, flag)
        compressor.average_(flat, bucket, sum_, extras=flat.numel() - numel)
        set_gradients(params, flat[:numel])
    return None if flag is None else flat[numel].item()


def flat_buffer(params, weight=1.0, flag=None):
    """(one buffer of the gradients of `params` times `weight`, then `flag` if given; the gradients' length).

    weight: this rank's share of the step's images times N, where the ranks' batches differ, so
    that the average over ranks weighs every image of the step alike (1.0 leaves the bits alone).
    flag: a number summed over the ranks along with the gradients (the stop flag), a few bytes.
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


class OverlappedGradientSum:
    """After loss.backward(), wait() returns once every gradient holds its average over ranks.

    Every rank must construct it at the same point (it creates the buckets' process groups).
    compressor_for(buckets) makes the compressor (utils/compress.py) for the buckets it forms.
    """

    def __init__(self, params, algorithm="two-pass", chunks="auto", bucket_bytes=1 << 20, timeout=None,
                 compressor_for=lambda buckets: NoCompression(), local_flag=lambda: 0.0):
        self.algorithm, self.chunks = algorithm, chunks
        self.buckets = make_buckets(list(reversed(list(params))), bucket_bytes)
        self.weight = 1.0                               # this step's gradient weight (see flat_buffer)
        self.weights = [1.0] * len(self.buckets)        # the weight each bucket was started with
        self.local_flag = local_flag                    # this rank's stop flag, read as the last bucket starts
        self.flag_bucket = len(self.buckets) - 1        # the first layer's: summed last, needed first
        self.flag_sum = 0.0                             # the flag summed over ranks, as of the last wait for it
        self.compressor = compressor_for(self.buckets)
        # gloo's own asynchronous all_reduce, started from the hook, when nothing is compressed
        self.gloo_async = algorithm == "gloo" and type(self.compressor) is NoCompression
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.missing = [len(b) for b in self.buckets]  # gradients still to come, this step
        self.started = 0                               # buckets 0..started-1 are being summed
        self.error = None
        self.busy_seconds = 0.0  # time spent summing, over all buckets, for bandwidth figures
        self.gloo_bytes_sent = self.gloo_bytes_summed = 0   # the async gloo path's traffic (no RingSum)
        self.lock = threading.Lock()
        # One group per bucket lets our rings sum the small conv bucket beside the big one, which
        # the lazy update needs (5% faster at 200 Mbit/s). gloo's buckets share one group: fewer
        # connections on the NIC measured 2% faster at 200 Mbit/s with 4 ranks.
        # The hierarchical sum needs several subgroups per bucket: a Hierarchy holds them.
        shared = self.gloo_async
        try:
            if algorithm == "hierarchical":
                groups = [Hierarchy(timeout=timeout) for _ in self.buckets]
            else:
                groups = [dist.new_group(backend="gloo", timeout=timeout) if dist.get_world_size() > 1 else None
                          for _ in range(1 if shared else len(self.buckets))]
        except RuntimeError as e:
            raise PeerError(f"lost a peer during start-up: {first_line(e)}") from None
        self.groups = groups * len(self.buckets) if shared else groups   # bucket i is summed in groups[i]
        self.sums = [RingSum(algorithm, chunks, group) for group in self.groups]
        if self.gloo_async:       # gloo sums asynchronously on its own threads, as DDP does
            self.pending = [None] * len(self.buckets)  # (flat buffer, work, times) per bucket
        else:                     # our rings are Python functions: a thread per bucket runs them
            self.ready = [threading.Event() for _ in self.buckets]    # gradients there: sum it
            self.summed = [threading.Event() for _ in self.buckets]   # averaged (or failed)
            for i in range(len(self.buckets)):
                threading.Thread(target=self._communicate, args=(i,), name=f"gradient-sum-{i}", daemon=True).start()
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self.bucket_of]

    def _on_gradient(self, param):  # runs inside backward, once per parameter
        with self.lock:
            self.missing[self.bucket_of[param]] -= 1
            self._start_complete_buckets()

    def _start_complete_buckets(self):
        """Start averaging each bucket whose gradients are all there, strictly in bucket order:
        collectives that share a group must be started in the same order on every rank."""
        while self.started < len(self.buckets) and self.missing[self.started] == 0:
            self._start(self.started)
            self.started += 1

    def _start(self, i):
        self.weights[i] = self.weight   # a lazy step's bucket thread may run after the next weight is set
        if timeline.recording():        # handed over, inside backward (its thread may start a moment later)
            now = timeline.now_ns()
            timeline.add("ready", now, now, bucket=i)
        if not self.gloo_async:
            self.ready[i].set()
            return
        flag = self.local_flag() if i == self.flag_bucket else None
        started_ns, times = timeline.now_ns(), [time.perf_counter()]
        flat, numel = flat_buffer(self.buckets[i], self.weight, flag)
        self.gloo_bytes_sent += ring.bytes_sent(flat.numel(), flat.element_size(), "gloo",
                                                self.sums[i].rank, self.sums[i].world_size)
        self.gloo_bytes_summed += flat.numel() * flat.element_size()
        try:
            work = dist.all_reduce(flat, group=self.groups[i], async_op=True)
            work.get_future().add_done_callback(lambda _: times.append(time.perf_counter()))
        except RuntimeError as e:  # raised inside backward: wait_bucket reports it
            self.error, work = e, None
        self.pending[i] = (flat, numel, work, times, started_ns, timeline.current_step())

    def _communicate(self, i):
        try:
            while True:
                self.ready[i].wait()
                self.ready[i].clear()
                start = time.perf_counter()
                flag = self.local_flag() if i == self.flag_bucket else None
                summed = average_gradients(self.buckets[i], self.sums[i], self.compressor, i, self.weights[i], flag)
                if flag is not None:
                    self.flag_sum = summed
                with self.lock:
                    self.busy_seconds += time.perf_counter() - start
                self.summed[i].set()
        except Exception as e:  # a dead peer: hand the error to the training thread
            self.error = e
            for event in self.summed:
                event.set()

    def backward_done(self):
        """Call after loss.backward(): buckets whose parameters took no part are summed as zeros."""
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
            if not self.gloo_async:
                self.summed[i].wait()
                if self.error is not None:
                    raise PeerError(first_line(self.error))  # the trainer says where
                self.summed[i].clear()
                return
            flat, numel, work, times, started_ns, step = self.pending[i]  # times: [started, finished by gloo]
            self.pending[i] = None
            try:
                if work is None:
                    raise self.error
                work.wait()
            except RuntimeError as e:  # gloo reports a dead or silent peer this way
                raise PeerError(first_line(e)) from None
        finished = times[1] if len(times) > 1 else time.perf_counter()
        self.busy_seconds += finished - times[0]
        if step is not None:      # gloo's threads ran it: drawn on a row of its own
            timeline.add("sum", started_ns, started_ns + int((finished - times[0]) * 1e9), f"gloo-sum-{i}",
                         bucket=i, step=step, algorithm="gloo", bytes=flat.numel() * flat.element_size())
        if i == self.flag_bucket:
            self.flag_sum = flat[numel].item()
        set_gradients(self.buckets[i], flat[:numel].div_(dist.get_world_size(self.groups[i])))

    def traffic(self):
        """(bytes this rank sent, bytes of the buffers summed), over all buckets and steps."""
        return (self.gloo_bytes_sent + sum(s.bytes_sent for s in self.sums),
                self.gloo_bytes_summed + sum(s.bytes_summed for s in self.sums))

    def wait(self):
        """After loss.backward(): block until all buckets are averaged."""
        self.backward_done()
        for i in range(len(self.buckets)):
            self.wait_bucket(i)

    def close(self):
        for hook in self.hooks:
            hook.remove()


class LazyUpdate:
    """Applies one training step's optimizer update bucket by bucket, as the next forward needs it.

    step() after backward only notes that an update is due. A forward pre-hook on each layer
    waits for that layer's bucket and updates it; a hook after the whole forward updates anything
    the forward did not use and advances the learning-rate schedule, so backward always starts
    from fully updated parameters. finish() applies whatever is due at once (before evaluating
    or saving).
    """

    def __init__(self, model, optimizer, scheduler, overlapped):
        self.optimizer, self.scheduler, self.overlapped = optimizer, scheduler, overlapped
        self.due = []                 # bucket indices whose update is still to be applied
        self.due_step = None
        self.waited_seconds = 0.0     # time the training thread blocked on communication
        self.handles = [model.register_forward_hook(lambda *_: self.finish())]
        for module in model.modules():
            mine = sorted({overlapped.bucket_of[p] for p in module.parameters(recurse=False)})
            if mine:
                self.handles.append(module.register_forward_pre_hook(
                    lambda *_, buckets=tuple(mine): self._update(buckets)))

    def step(self):
        self.overlapped.backward_done()
        self.due = list(range(len(self.overlapped.buckets)))
        self.due_step = timeline.current_step()   # the step these updates belong to, for the timeline

    def apply(self, bucket):
        """Wait for `bucket`'s sum and apply its update now rather than in the next forward."""
        self._update((bucket,))

    def _update(self, buckets):
        for i in buckets:
            if i in self.due:
                start = time.perf_counter()
                self.overlapped.wait_bucket(i)
                self.waited_seconds += time.perf_counter() - start
                self.due.remove(i)
                with timeline.span("optimizer", bucket=i, step=self.due_step):
                    step_only(self.optimizer, self.overlapped.buckets[i])
                for p in self.overlapped.buckets[i]:
                    p.grad = None
                if not self.due:      # the whole step is applied: now the next learning rate
                    self.scheduler.step()

    def finish(self):
        self._update(tuple(self.due))

    def close(self):
        for handle in self.handles:
            handle.remove()


def step_only(optimizer, params):
    """optimizer.step() for `params` alone, with the optimizer's current settings.

    For optimizers whose update is per parameter (Adam, SGD), stepping a model in pieces gives
    bit for bit the same result as one step over all of it.
    """
    wanted = {id(p) for p in params}
    groups = optimizer.param_groups
    optimizer.param_groups = [dict(g, params=[p for p in g["params"] if id(p) in wanted]) for g in groups]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = groups
