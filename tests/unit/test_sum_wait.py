"""The training thread's wait for a sum on another thread (utils/sync/interface.py): as long as it
takes in a whole group, at most ABANDON_SECONDS once the group broke. Every kind of sum waits so:
a bucket's (OverlappedSync), gloo's own asynchronous one, the plain sum (PlainSync) and a round's
(PeriodicSync). The sums here are stand-ins for a stuck receive; real cables pulled mid-sum are
bench/recovery/recovery.py --cut-rate's (one of each kind in tests/bench/test_bench_recovery.py)."""

import threading
import time

import pytest
import torch

from utils.comm.allreduce import Work
from utils.comm.compress import make_compressor
from utils.errors import PeerError
from utils.sync import buckets, interface
from utils.sync.buckets import OverlappedSync, PlainSync
from utils.sync.flags import Flags
from utils.sync.periodic import PeriodicSync

BOUND = 0.3  # ABANDON_SECONDS here


@pytest.fixture(autouse=True)
def short_bound(monkeypatch):
    monkeypatch.setattr(interface, "ABANDON_SECONDS", BOUND)


class HeldSum:
    """A sum over two stand-in ranks whose other rank's values equal this one's: it doubles the
    buffer once `release` is set (until then it is a receive waiting for data), or raises `error`."""

    world_size = 2
    bytes_sent = bytes_summed = 0

    def __init__(self, released=True, error=None):
        self.release, self.error, self.threads = threading.Event(), error, []
        if released:
            self.release.set()

    def __call__(self, flat, wire_dtype=None):
        self.threads.append(threading.current_thread())
        self.release.wait()
        if self.error is not None:
            raise self.error
        return flat.mul_(2)

    def weigh(self, weight):  # (the order of two alike ranks changes nothing)
        pass


def given_up_within_the_bound(call):
    started = time.monotonic()
    with pytest.raises(PeerError, match=f"did not end within {BOUND:g} s of the cut"):
        call()
    assert BOUND <= time.monotonic() - started < 5


def test_a_wait_lasts_as_long_as_the_sum_in_a_whole_group_and_is_given_up_once_it_broke():
    done, broken = threading.Event(), threading.Event()
    threading.Timer(2 * BOUND, done.set).start()
    interface.wait_for(done, broken)  # a whole group: the sum is waited for however long it takes
    done.clear()
    broken.set()
    threading.Timer(0.1, done.set).start()
    interface.wait_for(done, broken)  # broken, but the sum ended in time (a cut ends it, as a rule, at once)
    done.clear()
    given_up_within_the_bound(lambda: interface.wait_for(done, broken))


def test_a_buckets_sum_still_running_after_the_group_broke_is_given_up():
    sync = OverlappedSync.__new__(OverlappedSync)  # (no model, no group: only the wait)
    sync.native, sync.error, sync.timeline = False, None, buckets.OFF
    sync.summed, sync.broken = [threading.Event()], threading.Event()
    sync.summed[0].set()
    sync.wait_bucket(0)
    assert not sync.summed[0].is_set()  # (cleared for the next step)
    sync.broken.set()
    given_up_within_the_bound(lambda: sync.wait_bucket(0))


def test_gloos_own_sum_still_running_after_the_group_broke_is_given_up():
    sync = OverlappedSync.__new__(OverlappedSync)
    sync.native, sync.timeline, sync.broken, sync.busy_seconds = True, buckets.OFF, threading.Event(), 0.0
    sync.pending, sync.buckets, sync.allreduces, sync.flag_bucket = [None], [[]], [HeldSum()], 0
    sync.pending[0] = (torch.zeros(0), 0, Work(), 0, None)
    sync.broken.set()
    given_up_within_the_bound(lambda: sync.wait_bucket(0))


def plain_sync(model, held_sum, broken):
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    parts = ([params], [held_sum], make_compressor("none", [params]), optimizer, scheduler)
    sync = PlainSync(*parts, broken=broken)
    sync.begin(1.0, Flags(1))
    return sync


def backward(model):
    model.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_the_plain_sum_runs_on_the_training_thread_or_in_a_group_that_can_break_on_its_own():
    model = torch.nn.Linear(3, 2)
    for broken in (None, threading.Event()):
        held = HeldSum()
        sync = plain_sync(model, held, broken)
        grads = backward(model)
        sync.sum()  # (the other rank's gradients equal these: the average is these)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
        assert sync.flags().signalled == 2  # the flags rode with the sum, summed
        assert (held.threads[0] is threading.current_thread()) == (broken is None), held.threads


def test_a_plain_sum_still_running_after_the_group_broke_is_given_up_and_a_failed_one_says_why():
    model, broken = torch.nn.Linear(3, 2), threading.Event()
    held = HeldSum(released=False)
    sync = plain_sync(model, held, broken)
    backward(model)
    threading.Timer(0.1, broken.set).start()
    given_up_within_the_bound(sync.sum)
    held.release.set()  # its thread ends, writing the model's gradients: wait for it, or the next
    held.threads[0].join(timeout=5)  # backward() races it on them (one CI run segfaulted in zero_grad)
    sync = plain_sync(model, HeldSum(error=RuntimeError("Connection closed by peer\n  at gloo")), broken)
    backward(model)
    with pytest.raises(PeerError, match="^Connection closed by peer$"):
        sync.sum()


def test_a_rounds_sum_still_running_after_the_group_broke_is_given_up():
    model, broken = torch.nn.Linear(3, 2), threading.Event()
    held = HeldSum(released=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    compressor = make_compressor("none", [list(model.parameters())])
    sync = PeriodicSync(model, held, compressor, optimizer, scheduler, 2, broken=broken)
    for _ in range(2):  # a round: its sum starts at its end
        backward(model)
        sync.sum()
        sync.step()
    assert sync.pending is not None
    broken.set()
    given_up_within_the_bound(sync.finish)
    held.release.set()
