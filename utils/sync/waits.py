"""How the training thread waits for a sum that runs on another thread (a bucket's, the plain
sum's, gloo's own, a round's): as long as it takes, unless this rank's group has broken.

utils/elastic cuts every connection of a broken group. gloo then fails the receives still waiting
for data, but not one whose data was arriving at that moment: that one waits out the whole
--timeout (how often: docs/stopping-and-resuming.md). So a sum still running
ABANDON_SECONDS after the group broke is given up. Its thread is left to the timeout; the group it
waits on is not used again.

Every wait for a sum is also counted per thread (waited_since, seconds_waited): waiting for a slower
rank is nobody's work, so --balance leaves it out of a rank's own time (utils/balance/shares.py).
"""

import threading
import time

from utils.errors import PeerError

ABANDON_SECONDS = 2.0  # how long a sum may go on after this rank's group broke
LOOK_SECONDS = 0.1  # how often a wait looks whether the group broke (a sum that ends is seen at once)
_this_thread = threading.local()  # .seconds: what the thread has waited for sums so far


def waited_since(started):
    """The seconds since `started` (a time.perf_counter()), a wait for a sum: added to the calling
    thread's total (seconds_waited), and returned."""
    seconds = time.perf_counter() - started
    _this_thread.seconds = seconds_waited() + seconds
    return seconds


def seconds_waited():
    """The seconds the calling thread has waited for sums so far."""
    return getattr(_this_thread, "seconds", 0.0)


def wait_for(done, broken):
    """Block until the Event `done` is set. broken: the membership's Event of a broken group, or
    None (a group that cannot break: wait however long). Raises PeerError once the group has been
    broken for ABANDON_SECONDS and `done` is still not set."""
    broken_at = None
    while not done.wait(None if broken is None else LOOK_SECONDS):
        if broken.is_set():
            broken_at = broken_at or time.monotonic()
            if time.monotonic() - broken_at > ABANDON_SECONDS:
                raise PeerError(f"the sum did not end within {ABANDON_SECONDS:g} s of the cut")
