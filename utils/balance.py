"""--balance: each rank takes the share of every step's images that its speed can carry.

Without it every rank takes an equal share of a step, so every step waits for the slowest
server. With it, a step's images are cut at different points:

    step s: the epoch's permutation, entries G*s .. G*s+G-1 (G = the global batch)
    |------------- rank 0 -------------|------ rank 1 ------|---------- rank 2 ----------|
                share 0                      share 1                  share 2

The steps, the data order and every image of an epoch exactly once stay as they are; each
rank's gradient weighs its share (utils/run.py's weight), so the average counts every image
alike and the parameters stay identical on every rank.

How the ranks agree, with no message of their own:
  1. Each rank measures the time its own work needed over its last WINDOW steps: the time its
     Python threads ran, plus the time its threads were ready to run but had no CPU (a CPU
     quota, other people's jobs), from the kernel's schedstat (needed_seconds); not the time
     they slept, waiting for the other ranks. Its speed: its images per second of that.
  2. It sends that speed as a whole number on a log scale (speed_code: 16 codes per doubling,
     exact in every wire format the sums use) in its own slot of the values that ride with the
     gradient sum (utils.sync.interface.Flags). The sum gives every rank every rank's code, at
     the same step.
  3. Every REVIEW steps each rank turns the codes into shares with the same whole-number
     arithmetic (shares_of), and the ranks adopt them only if a share moves by more than
     THRESHOLD of itself (noise in the timings does not make the shares flap).

A change of members (a lost rank, a join) starts again from equal shares: the new ranks' speeds
arrive with the next sums. --balance A:B:... fixes the shares in those proportions instead (no
measuring; for comparisons, and for a resume test that must be bit for bit).
"""

import math
import os
import threading
from collections import deque

WINDOW = 10  # steps of this rank's timing in its speed
REVIEW = 10  # steps between two looks at the speeds: a change is followed within about 20 steps
THRESHOLD = 0.10  # a share must move by more than this fraction of itself (and 1 image) to change
CODES_PER_DOUBLING = 16  # speed codes: 2**(code/16) images per second, 4.4% apart
MAX_CODE = 255  # whole numbers up to 256 are exact in bfloat16, the narrowest wire format
# 2**(i/16) * 2**16, rounded: the codes' weights in whole numbers, so that every rank (whatever its
# CPU and maths library) computes the same shares
FRACTIONS = (65536, 68438, 71468, 74632, 77936, 81386, 84990, 88752, 92682, 96785, 101070, 105545, 110218, 115098)
FRACTIONS += (120194, 125515)


def speed_code(images, seconds):
    """Images per second as a code 1..MAX_CODE (0: nothing measured). Only this rank computes its
    own, so floating point is fine here; every rank turns the codes into shares alike (weight_of)."""
    if images <= 0 or seconds <= 0:
        return 0
    return min(MAX_CODE, max(1, round(CODES_PER_DOUBLING * math.log2(images / seconds))))


def images_per_second(code):
    """What a speed code stands for (for the log line)."""
    return 2 ** (code / CODES_PER_DOUBLING)


def weight_of(code):
    """A code's weight in whole numbers: 2**(code/16) * 2**16, the same on every machine."""
    return FRACTIONS[code % CODES_PER_DOUBLING] << (code // CODES_PER_DOUBLING)


def shares_of(size, weights):
    """`size` images cut in proportion to `weights` (whole numbers): the largest remainders get
    the images left over (the lower rank first on a tie); every rank gets at least one image when
    there are as many images as ranks."""
    n, total = len(weights), sum(weights)
    shares = [size * w // total for w in weights]
    by_remainder = sorted(range(n), key=lambda r: (-(size * weights[r] % total), r))
    for r in by_remainder[: size - sum(shares)]:
        shares[r] += 1
    if size >= n:
        for r in range(n):
            if shares[r] == 0:
                donor = max(range(n), key=lambda d: (shares[d], -d))
                shares[donor] -= 1
                shares[r] = 1
    return shares


def needed_seconds():
    """The time this process's work has needed so far: the time its Python threads ran (the
    training loop's, the sums'), and the time any of its threads was ready to run but had no CPU
    (throttled by a quota, or behind other processes), so a stall counts wherever it strikes; not
    the time they slept, waiting for a peer. Torch's compute threads run beside the training loop,
    in the same time, so their running is left out: on many cores this is still the step's time.
    From Linux's schedstat: nanoseconds run, nanoseconds waiting for a CPU, time slices."""
    ours = {str(thread.native_id) for thread in threading.enumerate()}
    total = 0
    for thread in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{thread}/schedstat", "rb") as f:
                ran, waited, _ = f.read().split()
        except (OSError, ValueError):  # a thread that has just ended
            continue
        total += int(waited) + (int(ran) if thread in ours else 0)
    return total / 1e9


def parse_fixed(text):
    """'5:2' -> (5, 2); ValueError with a message otherwise."""
    try:
        parts = tuple(int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"expected 'measured' or whole-number proportions A:B:..., e.g. 5:2, not {text!r}") from None
    if len(parts) < 2 or min(parts) < 1:
        raise ValueError(f"expected at least two proportions, each at least 1, e.g. 5:2, not {text!r}")
    return parts


class Balance:
    """This rank's view of the shares: the agreed weights, its own timings, the reviews.

    mode: 'measured', or proportions A:B:... (parse_fixed). global_batch: G."""

    def __init__(self, mode, rank, world_size, global_batch):
        self.fixed = None if mode == "measured" else parse_fixed(mode)
        self.global_batch = global_batch
        self.timings = deque(maxlen=WINDOW)  # (images, seconds) of this rank's last steps
        self.changes = 0  # re-balances so far (the timeline and the log say them)
        self.restart(rank, world_size)

    def restart(self, rank, world_size, weights=None):
        """A new group (the start, a resume, a change of members): equal shares, or `weights`;
        fixed proportions hold while the group has as many ranks as they have parts."""
        self.rank, self.world_size = rank, world_size
        if weights is None and self.fixed is not None and len(self.fixed) == world_size:
            weights = self.fixed
        self.weights = tuple(weights) if weights is not None else (1,) * world_size

    def shares(self, size=None):
        """Every rank's images of a step of `size` images (default: a whole global batch)."""
        return shares_of(self.global_batch if size is None else size, self.weights)

    def timed(self, images, seconds):
        """This rank's last step took it `seconds` of work (needed_seconds) for `images`."""
        if self.fixed is None and images > 0:
            self.timings.append((images, seconds))

    def slots(self):
        """What this rank adds to the sum: its speed code in its own slot, zeros elsewhere."""
        if self.fixed is not None:
            return ()
        code = 0
        if len(self.timings) >= WINDOW // 2:  # not the first steps alone: they pay for warming up
            code = speed_code(sum(i for i, _ in self.timings), sum(s for _, s in self.timings))
        return tuple(code if r == self.rank else 0 for r in range(self.world_size))

    def review(self, step, codes):
        """After `step` (of the epoch), with every rank's speed codes from its sum: new weights if
        it is time to look and the shares have moved enough. True when they changed."""
        if self.fixed is not None or step % REVIEW or len(codes) != self.world_size or min(codes) < 1:
            return False
        weights = tuple(weight_of(c) for c in codes)
        old, new = self.shares(), shares_of(self.global_batch, weights)
        if not any(abs(b - a) > max(1, THRESHOLD * a) for a, b in zip(old, new)):
            return False
        self.weights = weights
        self.changes += 1
        return True
