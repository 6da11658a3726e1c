"""The training thread's wait for a bucket's sum (utils/sync/buckets.py): bounded once the group broke."""

import threading
import time

import pytest

from utils.errors import PeerError
from utils.sync import buckets
from utils.sync.buckets import OverlappedSync


def test_a_buckets_sum_still_running_after_the_group_broke_is_given_up(monkeypatch):
    # gloo leaves a receive whose data was arriving when its connection was cut waiting for the
    # whole --timeout; the training thread waits for it at most ABANDON_SECONDS once the group broke
    monkeypatch.setattr(buckets, "ABANDON_SECONDS", 0.3)
    sync = OverlappedSync.__new__(OverlappedSync)  # (no model, no group: only the wait)
    sync.native, sync.error, sync.timeline = False, None, buckets.OFF
    sync.summed, sync.broken = [threading.Event()], threading.Event()
    threading.Timer(0.5, sync.summed[0].set).start()
    sync.wait_bucket(0)  # a whole group: the sum is waited for however long it takes
    assert not sync.summed[0].is_set()
    sync.broken.set()
    threading.Timer(0.1, sync.summed[0].set).start()
    sync.wait_bucket(0)  # broken, but the sum ended in time (a cut ends it, as a rule, at once)
    started = time.monotonic()
    with pytest.raises(PeerError, match="did not end within 0.3 s of the cut"):
        sync.wait_bucket(0)
    assert 0.3 <= time.monotonic() - started < 5
