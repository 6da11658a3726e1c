"""The all-reduce as an object: one class per --allreduce, made by make_allreduce().

    allreduce = make_allreduce("ring")        # a collective when it makes process groups
    allreduce.sum_(flat)                      # in place: the element-wise sum over all ranks
    allreduce.sum_(flat, torch.bfloat16)      # 16-bit messages, float32 adds (utils/comm/ring.py)
    work = allreduce.sum_async(flat); work.wait()
    allreduce.weigh(weight)                   # this rank's share of a step, times N (may reorder the ranks)
    allreduce.bytes_sent, allreduce.bytes_summed, allreduce.world_size, allreduce.rank

An object owns the process group(s) it sums over, so a caller never needs to know which kind
of group an algorithm takes (the hierarchical sum takes several, a utils.comm.hierarchical.Hierarchy).
Every class counts the bytes this rank sends and draws the sum's timeline span in one place,
AllReduce.sum_; the kernels themselves are the plain functions of utils/comm/ring.py and
utils/comm/hierarchical.py. Algorithm names are compared only in make_allreduce.
"""

import threading
import time

import torch
import torch.distributed as dist

from utils.comm import hierarchical, ring
from utils.comm.names import ALGORITHMS
from utils.timeline import OFF


class Work:
    """What sum_async and beside return: wait() blocks until the work is done and returns what it
    returned, or raises what it raised. `started` and `finished` are perf_counter() times (finished:
    None until it is done); `done` is set when it is (utils/sync/interface.py waits on it)."""

    def __init__(self):
        self.started, self.finished = time.perf_counter(), None
        self.done, self._error, self._result = threading.Event(), None, None

    def _finish(self, error=None, result=None):
        self.finished, self._error, self._result = time.perf_counter(), error, result
        self.done.set()

    def wait(self):
        self.done.wait()
        if self._error is not None:
            raise self._error
        return self._result


def beside(work, name):
    """Run work() on a thread of its own, named `name`; returns a Work (a lost peer's error: wait() raises it)."""
    started = Work()

    def run():
        try:
            started._finish(result=work())
        except Exception as e:
            started._finish(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return started


class AllReduce:
    """Sums one flat tensor over all ranks of `group` (None: the default group), in place."""

    name = None
    native_async = False  # True: sum_async needs no thread of ours (gloo's own threads run it)
    timeline = OFF  # where sum_ draws its span (make_allreduce hands over the run's)

    def __init__(self, group=None):
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.bytes_sent = 0  # by this rank, over all calls
        self.bytes_summed = 0  # the buffers' sizes on the wire, over all calls (for busbw)

    def sum_(self, flat, wire_dtype=None):
        """Replace `flat` by its sum over all ranks; every rank ends with the same bits."""
        wire_size = element_size(wire_dtype or flat.dtype)
        sent = self.bytes_for(flat.numel(), flat.element_size(), wire_size)
        with self.timeline.span(
            "all-reduce",
            algorithm=self.name,
            bytes_sent=sent,
            bytes=flat.numel() * wire_size,
            chunks=self.trace_chunks(flat.numel(), wire_dtype) if self.timeline.recording else None,
        ):
            self._sum(flat, wire_dtype)
        self.count(flat.numel(), sent, wire_size)
        return flat

    __call__ = sum_  # the compressors call `sum_(buffer, wire_dtype)`

    def sum_async(self, flat, wire_dtype=None):
        """Start sum_ on a thread of its own; returns a Work."""
        return beside(lambda: self.sum_(flat, wire_dtype), f"{self.name}-sum")

    def count(self, numel, sent, wire_size):
        self.bytes_sent += sent
        self.bytes_summed += numel * wire_size

    def bytes_for(self, numel, element_size, wire_size):
        """How many bytes this rank sends in one sum of `numel` elements of `wire_size` bytes."""
        return ring.ring_bytes_sent(numel, wire_size, self.rank, self.world_size)

    def trace_chunks(self, numel, wire_dtype):
        return None

    def weigh(self, weight):
        """This rank's gradient weighs `weight` in the sums that follow (its share of the step's
        images times N: utils/sync/buckets.py). An algorithm whose bits do not depend on the order of
        its ranks may reorder them by it; these do not."""

    def note(self):
        """What rank 0 says about this sum at start-up, if anything (None)."""
        return None

    def _sum(self, flat, wire_dtype):
        raise NotImplementedError


class TwoPass(AllReduce):
    """The original chain (ring.two_pass_ring_sum), streamed in `chunks` pieces ("auto": by size)."""

    name = "two-pass"

    def __init__(self, group=None, chunks="auto", one_host=False):
        super().__init__(group)
        self.chunks, self.one_host = chunks, one_host  # one_host: every rank on one host (ring.auto_chunks)
        self.first = 0  # the rank the chain starts at (weigh)

    def weigh(self, weight):
        """Two ranks: the chain starts at the one with fewer images (weight below 1), under --balance
        the slower server, so that the faster adds last and has the total at once (measured:
        bench/balance/NOTES.md). g0 + g1 is g1 + g0 to the bit; with more ranks the chain's order is
        the sum's, so it stays. Both ranks choose alike: their weights add up to 2."""
        if self.world_size == 2:
            self.first = 0 if weight == 1.0 else self.rank if weight < 1.0 else 1 - self.rank

    def _sum(self, flat, wire_dtype):
        chunks = self.trace_chunks(flat.numel(), wire_dtype)
        ring.two_pass_ring_sum(flat, chunks, self.group, wire_dtype, self._first(wire_dtype in (None, flat.dtype)))

    def _first(self, exact):
        """Where the chain starts: weigh's choice on a wire of the buffer's own type (exact); a 16-bit
        wire rounds the head's gradient, not the adder's, so the order counts there (rank 0 first)."""
        return self.first if exact else 0

    def trace_chunks(self, numel, wire_dtype):
        return ring.resolve_chunks(self.chunks, numel, wire_dtype, self.one_host)

    def bytes_for(self, numel, element_size, wire_size):
        place = (self.rank - self._first(wire_size == element_size)) % self.world_size
        return ring.two_pass_bytes_sent(numel, wire_size, place, self.world_size)


class Ring(AllReduce):
    """Reduce-scatter, then all-gather (ring.ring_sum): the bandwidth-optimal ring."""

    name = "ring"

    def _sum(self, flat, wire_dtype):
        ring.ring_sum(flat, self.group, wire_dtype)


class Gloo(AllReduce):
    """gloo's own all_reduce (ring.gloo_sum), the reference; counted as a ring."""

    name = "gloo"
    native_async = True

    def _sum(self, flat, wire_dtype):
        ring.gloo_sum(flat, self.group, wire_dtype)

    def sum_async(self, flat, wire_dtype=None):
        """gloo's asynchronous all_reduce, on gloo's threads (as DDP does); float32 only."""
        assert wire_dtype is None or wire_dtype == flat.dtype, "gloo's async sum carries the buffer's own type"
        work = Work()
        self.count(
            flat.numel(), self.bytes_for(flat.numel(), flat.element_size(), flat.element_size()), flat.element_size()
        )
        if self.world_size == 1:
            work._finish()
            return work
        try:
            gloo_work = dist.all_reduce(flat, group=self.group, async_op=True)
        except RuntimeError as e:
            work._finish(e)
            return work
        gloo_work.get_future().add_done_callback(lambda _: work._finish())
        work.wait = lambda: (gloo_work.wait(), None)[1]  # gloo's wait raises a lost peer's error
        return work


class Hierarchical(AllReduce):
    """Loopback within each host, a ring per shard across hosts (utils/comm/hierarchical.py).
    Spans the default group; owns one Hierarchy (its subgroups)."""

    name = "hierarchical"

    def __init__(self, hierarchy):
        super().__init__(None)
        self.hierarchy = hierarchy

    def _sum(self, flat, wire_dtype):
        self.hierarchy.sum_(flat, wire_dtype)

    def bytes_for(self, numel, element_size, wire_size):  # loopback legs in the buffer's type
        return self.hierarchy.bytes_sent(numel, element_size, wire_size)

    def note(self):
        return hierarchical.uneven_note(self.hierarchy.hosts)


def element_size(dtype):
    return torch.empty(0, dtype=dtype).element_size()


def make_allreduce(name, chunks="auto", timeout=None, own_group=False, hosts=None, timeline=OFF):
    """The all-reduce for --allreduce `name` (chunks: the two-pass ring's pieces).

    own_group: sum over a new process group of all ranks with connections of its own (a bucket
    of utils/sync/buckets.py must not queue behind another on one socket); else the default group.
    The hierarchical sum always makes its subgroups (over `hosts`, default: discover()); the
    two-pass ring streams its buffer in one piece when `hosts` is one host (ring.auto_chunks).
    Both are collectives: every rank makes the same all-reduces in the same order.
    timeout: the new groups' (None: the default group's). timeline: where each sum draws its span.
    """
    allreduce = _make(name, chunks, timeout, own_group, hosts)
    allreduce.timeline = timeline
    return allreduce


def _make(name, chunks, timeout, own_group, hosts):
    if name not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
    timeout = timeout or default_timeout()
    if name == "hierarchical":
        return Hierarchical(hierarchical.Hierarchy(hosts, timeout))
    group = dist.new_group(backend="gloo", timeout=timeout) if own_group and dist.get_world_size() > 1 else None
    if name == "two-pass":
        return TwoPass(group, chunks, one_host=hierarchical.one_host(hosts))
    return Ring(group) if name == "ring" else Gloo(group)


def default_timeout():
    """The default group's timeout (new groups would otherwise get torch's 30 minutes)."""
    try:
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None
