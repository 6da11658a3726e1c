"""--balance: each rank takes the share of every step's images that its speed can carry.

Why this long: the speed codes, the shares and the rules that move them are one piece of logic;
its cost model and its review read each other's fields.

Without it every rank takes an equal share of a step, so every step waits for the slowest
server. With it, a step's images are cut at different points:

    step s: the epoch's permutation, entries G*s .. G*s+G-1 (G = the global batch)
    |------------- rank 0 -------------|------ rank 1 ------|---------- rank 2 ----------|
                share 0                      share 1                  share 2

The steps, the data order and every image of an epoch exactly once stay as they are; each
rank's gradient weighs its share (utils/run.py's weight), so the average counts every image
alike and the parameters stay identical on every rank.

How the ranks agree, with no message of their own:
  1. Each rank times its own work (start, computed, ended: utils/run.py's train_step marks them)
     in two parts: its forward and backward, which grow with its images (a rate, fitted over the
     shares it has had, since a step also has a cost of its own), and the rest of a step (its part
     of the sum and the optimizer: overhead). Both on its own clock: CPU time stretched by what held
     it back (an old CPU, other people's jobs, a CPU quota's stalls), less its waits for the others.
     When its recent steps' stretch moves by CHANGED, it forgets the older ones.
  2. It sends both as speed codes (whole numbers on a log scale, exact in every wire format) in its
     two slots of the flags that ride with the gradient sum (utils/sync/flags.py): every rank gets
     every rank's codes at the same step.
  3. Every REVIEW steps each rank solves, in exact fractions (the same on every machine), for the
     shares that give every rank the same step time. The shares move only when two looks in a row
     want the move (one after a change of speed or in a new group), it is large enough (THRESHOLD),
     and it gains GAIN (not after a change, nor at the look after a new group's first move, which
     was solved on a guess), or PERSIST looks want it: noise must not make the shares flap.
The measurements behind each rule and constant, and what was tried and dropped:
bench/balance/NOTES.md.

A change of members (a lost rank, a join) starts again from equal shares: the new ranks' speeds
arrive with the next sums. --balance A:B:... fixes the shares in those proportions instead (no
measuring; for comparisons, and for a resume test that must be bit for bit).
"""

import math
import statistics
import time
from collections import deque
from fractions import Fraction

from utils.balance.cpu import CpuGroup, own_seconds, snapshot
from utils.sync.flags import MAX_SPEED
from utils.sync.interface import seconds_waited

WINDOW = 20  # steps of this rank's timing in its speed, at most: long enough to span 10 of a CPU quota's 100 ms periods
REVIEW = 5  # steps between two looks at the speeds
MEASURED = 3  # steps a rank times at the current shares before it sends codes (a run's first is not timed)
FIRST_LOOK = 2  # the same in a new group at equal shares: every step at them keeps the fast ranks waiting
HISTORY = 40  # steps over which a rank's stretch (own time over CPU time) is measured: 10 CPU quota periods
RECENT = 8  # a rank's last steps, against its history's older ones: has its speed changed?
# the part of its CPU quota a rank's share is solved to use (all of it: throttled, it stalls all; 0.8: a first look
# landed further from the best split, bench/balance/NOTES.md)
QUOTA_USE = 0.9
CHANGED = 1.5  # the recent steps' stretch, this many times the older ones' (or 1/this): a change
LEVELS = 4  # a rank's windows at its earlier shares (since its speed last changed) that its cost is fitted on
OWN_COST = 0.2  # a step's own part of its compute until a fit tells (fitted here at 32 images: 17-25%)
SPAN = 0.25  # those windows' shares must span this fraction of their mean (and 4 images) for a fit
THRESHOLD = 0.10  # a share must move by more than this fraction of itself (and 2 images) to turn back
GAIN = Fraction(15, 100)  # a move must make a step this much shorter, as the codes see it (unless it follows a change)
PERSIST = 4  # looks in a row that want the same move: made whatever its gain (the codes by then span WINDOW steps)
CODES_PER_DOUBLING = 16  # speed codes: 2**(code/16) per second, 4.4% apart
MAX_CODE = MAX_SPEED  # a speed code rides alone in its slot of the step's flags (utils/sync/flags.py)
# 2**(i/16) * 2**16, rounded: the codes' values as exact fractions, so that every rank (whatever its
# CPU and maths library) computes the same shares
FRACTIONS = (65536, 68438, 71468, 74632, 77936, 81386, 84990, 88752, 92682, 96785, 101070, 105545, 110218, 115098)
FRACTIONS += (120194, 125515)


def own_clock():
    """This rank's own clock: the seconds that passed, less those its training thread waited for
    sums (utils/sync/interface.py counts them). Waiting for a slower rank is nobody's work; a CPU taken
    by someone else, or a quota's stall, is this rank's."""
    return time.monotonic() - seconds_waited()


def speed_code(count, seconds):
    """`count` per `seconds` (images, or steps) as a code 1..MAX_CODE; 0: nothing measured. Only
    this rank computes its own, so floating point is fine here; every rank reads the codes alike
    (code_value)."""
    if count <= 0:
        return 0
    if seconds <= 0:
        return MAX_CODE
    return min(MAX_CODE, max(1, round(CODES_PER_DOUBLING * math.log2(count / seconds))))


def code_value(code):
    """What a code stands for: 2**(code/16), as an exact fraction (the same on every machine)."""
    return Fraction(FRACTIONS[code % CODES_PER_DOUBLING] << (code // CODES_PER_DOUBLING), 2**16)


def solve(global_batch, rate_codes, overhead_codes):
    """The whole-number shares of a step's images that give every rank the same step time,
    overhead_r + share_r / rate_r, each at least one image (rate codes: images per second;
    overhead codes: 1 / seconds a step)."""
    n = len(rate_codes)
    rates = [code_value(c) for c in rate_codes]
    overheads = [1 / code_value(c) for c in overhead_codes]
    floor, exact = set(), None
    while exact is None or any(exact[r] < 1 for r in range(n) if r not in floor):
        floor |= {r for r in range(n) if exact is not None and exact[r] < 1}
        free = [r for r in range(n) if r not in floor]
        step = (global_batch - len(floor) + sum(overheads[r] * rates[r] for r in free)) / sum(rates[r] for r in free)
        exact = [Fraction(1) if r in floor else (step - overheads[r]) * rates[r] for r in range(n)]
    return apportion(global_batch, exact)


def step_time(shares, rate_codes, overhead_codes):
    """The time a step of these shares takes, as the codes see it: the slowest rank's overhead +
    share / rate (exact fractions)."""
    return max(1 / code_value(o) + share / code_value(r) for share, r, o in zip(shares, rate_codes, overhead_codes))


def apportion(size, exact):
    """Whole numbers summing to `size`, each the floor of its exact share or one more: the largest
    remainders get the images left over (the lower rank first on a tie)."""
    shares = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda r: (-(exact[r] - shares[r]), r))
    for r in by_remainder[: size - sum(shares)]:
        shares[r] += 1
    return shares


def shares_of(size, weights):
    """`size` images cut in proportion to `weights` (whole numbers: the shares of a whole step, or
    fixed proportions); every rank gets at least one image when there are as many images as ranks."""
    n, total = len(weights), sum(weights)
    shares = apportion(size, [Fraction(size * w, total) for w in weights])
    if size >= n:
        for r in range(n):
            if shares[r] == 0:
                donor = max(range(n), key=lambda d: (shares[d], -d))
                shares[donor] -= 1
                shares[r] = 1
    return shares


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

    def __init__(self, mode, rank, world_size, global_batch, threads=1):
        self.fixed = None if mode == "measured" else parse_fixed(mode)
        self.global_batch, self.threads = global_batch, threads  # threads: torch's, on this rank
        self.group = CpuGroup()
        self.timings = deque(maxlen=WINDOW)  # (images, CPU seconds of compute, of the rest) at the current shares
        self.levels = deque(maxlen=LEVELS)  # (images, CPU seconds of compute) a step, at its earlier shares
        self.cost = None  # (CPU seconds a step, an image) of compute, as last fitted on the levels
        self.history = deque(maxlen=HISTORY)  # (CPU s, own s) of compute, of the rest; process CPU s: its stretch
        self.changes = 0  # re-balances so far (the timeline and the log say them)
        self.changed = False  # its speed changed since the last review (forget_if_changed)
        self.cores = None  # its CPU group's quota in cores when it was last timed (None: no quota)
        self.marks = []  # the step's clock so far (start, computed)
        self.restart(rank, world_size)

    def restart(self, rank, world_size, weights=None):
        """A new group (the start, a resume, a change of members): equal shares, or `weights`;
        fixed proportions hold while the group has as many ranks as they have parts."""
        self.rank, self.world_size = rank, world_size
        if weights is None and self.fixed is not None and len(self.fixed) == world_size:
            weights = self.fixed
        self.weights = tuple(weights) if weights is not None else (1,) * world_size
        self.direction = [0] * world_size  # each rank's last move (its sign)
        self.wished = None  # the moves the last review wanted (their signs), if it did not make them
        self.wanted, self.looks = None, 0  # the move the last look wanted whatever its gain; looks in a row wanting it
        self.following = False  # the last move followed a change of speed: a move on needs one look
        self.guessed = False  # the last move was a new group's first, solved on OWN_COST's guess
        self.warm = False  # a step at these shares has run (the first is not timed: see review)
        self.due = False  # a REVIEW-th step has passed since the last look (--sync-every: codes come once a round)
        # a new group at equal shares knows nothing of its ranks' speeds: its first look comes as soon
        # as every rank has timed FIRST_LOOK steps, and moves alone (a look every REVIEW steps, and two
        # of them for a move, kept a job at equal shares for its first 10 steps: bench/balance/NOTES.md)
        self.fresh = weights is None

    def shares(self, size=None):
        """Every rank's images of a step of `size` images (default: a whole global batch)."""
        return shares_of(self.global_batch if size is None else size, self.weights)

    # A step's clock (utils/run.py's train_step marks it): its start, the end of its forward and
    # backward, its end. Each mark is (own_clock(), the training thread's CPU time, its process's CPU
    # time or snapshot: utils/balance/cpu.py); the waits and stalls count only in the rest of a step.
    def start(self):
        self.marks = [(own_clock(), time.thread_time(), time.process_time())]

    def computed(self):
        self.marks.append((own_clock(), time.thread_time(), snapshot(self.group)))

    def ended(self, images):
        """The step of `images` images is over: it is timed."""
        self.timed(images, *self.marks, (own_clock(), time.thread_time(), snapshot(self.group)))

    def state(self, world_size):
        """What a checkpoint of `world_size` ranks keeps: the weights of the shares (None: equal, or
        weights for another number of ranks)."""
        return list(self.weights) if len(self.weights) == world_size else None

    def timed(self, images, started, computed, ended):
        """This rank's last step: `images`, and its marks (start, computed, ended)."""
        if self.fixed is None and images > 0:
            if self.warm:
                compute_cpu, compute = computed[1] - started[1], computed[0] - started[0]
                rest_cpu = (ended[2][0] - computed[2][0]) / self.threads
                self.timings.append((images, compute_cpu, rest_cpu))
                rest, process_cpu = own_seconds(computed[2], ended[2], self.threads), ended[2][0] - started[2]
                self.history.append((compute_cpu, compute, rest_cpu, rest, process_cpu))
                self.forget_if_changed()
            self.warm = True

    def stretch(self):
        """How much longer than its CPU time this rank's work takes, over its history: (for its
        forward and backward, for the rest of a step); about 1 on a server of its own.

        In a CPU group with a quota of q cores, at least its process's CPU time over QUOTA_USE * q:
        however fast the steps it was timed on ran, its quota holds it to q CPU-seconds a second
        on average, and a step that overdraws it stalls every rank for the rest of a quota period.
        Solved to use all of its quota, a rank is throttled in most periods, each time in the
        middle of somebody's step (measured: bench/balance/NOTES.md)."""
        compute_cpu, compute, rest_cpu, rest, _ = (sum(column) for column in zip(*self.history))
        least = quota_stretch(self.history, self.cores) / QUOTA_USE  # (the quota as read at its last step)
        return max(least, compute / max(compute_cpu, 1e-9)), max(least, rest / max(rest_cpu, 1e-9))

    def forget_if_changed(self):
        """If this rank's CPU quota changed, or its last RECENT steps were stretched CHANGED times
        more than its history's older ones, or less, its speed has changed (a quota came or went,
        another job on its server started or ended): the history keeps only the steps since, so
        that the next review sees the new speed whole, not diluted by the old. (A rank given an
        image or two a step under a quota is seldom stalled, so the stretch misses the quota's
        end; the quota itself is certain. It is read at a step's end, so that step ran in part at
        the old quota: kept, one stalled step of a third of a core made the first look after the
        quota's end see a rank half again as slow as it was, bench/balance/NOTES.md.)"""
        cores, self.cores = self.cores, self.group.cores()
        if cores != self.cores and len(self.history) > 1:
            self.history, self.changed = deque(maxlen=HISTORY), True
        elif len(self.history) >= 2 * RECENT:
            older, recent = list(self.history)[:-RECENT], list(self.history)[-RECENT:]
            ratio = stretched(recent, self.cores) / stretched(older, self.cores)
            if not 1 / CHANGED < ratio < CHANGED:  # (the change came within the recent steps: their last half)
                self.history, self.changed = deque(recent[RECENT // 2 :], maxlen=HISTORY), True

    def slots(self):
        """What this rank adds to the sum: its rate and overhead codes in its own two slots (rank r:
        r and N + r), zeros elsewhere; after them whether its speed changed (forget_if_changed)."""
        if self.fixed is not None:
            return ()
        rate = overhead = 0
        steps, needed = len(self.timings), FIRST_LOOK if self.fresh else MEASURED
        if steps >= needed and self.history:  # (a step's sum carries the steps before it: REVIEW - 1 of them)
            images, compute, rest = (sum(column) / steps for column in zip(*self.timings))
            self.cost = fit([*self.levels, (images, compute)]) or self.cost
            per_step = min(self.cost[0], compute / 2) if self.cost else OWN_COST * compute
            per_image = (compute - per_step) / images
            stretch, rest_stretch = self.stretch()
            rate, overhead = speed_code(1, per_image * stretch), speed_code(1, rest * rest_stretch + per_step * stretch)
        n = self.world_size
        codes = tuple(rate if r == self.rank else overhead if r == n + self.rank else 0 for r in range(2 * n))
        return (*codes, int(self.changed and rate > 0))

    def review(self, step, codes):
        """After `step` (of the epoch), with the codes of its sum (every rank's rate and overhead,
        then how many said their speed changed; () when no sum came with the step): new shares if
        it is time to look (every REVIEW steps, or at the first codes after that) and they have
        moved enough. True when they changed."""
        n = self.world_size
        self.due = self.due or step % REVIEW == 0
        if not codes:  # no sum this step (--sync-every: one a round): the look waits for the round's codes
            return False
        due, self.due = self.due, False
        if self.fixed is not None or len(codes) != 2 * n + 1 or min(codes[: 2 * n]) < 1:
            return False
        if not due and not self.fresh:  # (a new group's first look comes at any step)
            return False
        # (a new group's first look moves alone, and the moves on after it as after a change of speed)
        changed, fresh, self.changed, self.fresh = codes[2 * n] > 0, self.fresh, False, False
        rates, overheads = codes[:n], codes[n : 2 * n]
        old, new = self.shares(), solve(self.global_batch, rates, overheads)
        moves = [b - a for a, b in zip(old, new)]
        # two looks in a row must want the move (one slow stretch of steps is no change), or one if
        # a rank saw its speed change, and for each move on after that one while they go on (a
        # change of speed is followed in a few moves: the first solves are off by the old speeds
        # still in the timings); a move on in the direction of the last one needs 2 images, a move
        # back more than THRESHOLD (noise turns shares back and forth), but 2 at the look after a first
        # move (that move was solved on OWN_COST's guess, this look on a fitted cost: a guess is no
        # noise to hold against; bench/balance/NOTES.md). And a move must make a step GAIN shorter, as
        # the codes see it, unless it goes on after a change of speed or a first move, or it is that
        # look after a first move; a first move too (on equal servers it would follow two steps'
        # noise); or PERSIST looks want it
        onward = any(moves) and all(m == 0 or m * d > 0 for m, d in zip(moves, self.direction))
        enough = any(abs(m) > (1 if onward or self.guessed else max(2, THRESHOLD * a)) for m, a in zip(moves, old))
        following = changed or self.guessed or (self.following and onward)
        worth = following or step_time(new, rates, overheads) <= (1 - GAIN) * step_time(old, rates, overheads)
        want = tuple((m > 1) - (m < -1) for m in moves) if enough else (0,) * n
        wish = want if worth else (0,) * n
        self.looks = ((self.looks if want == self.wanted else 0) + 1) if any(want) else 0
        self.wanted = want
        moved = (any(wish) and (wish == self.wished or following or fresh)) or self.looks >= PERSIST  # (wish: enough)
        self.wished, self.following, self.guessed = wish, moved and (following or fresh), moved and fresh
        if not moved:
            return False
        self.weights, self.direction, self.wished, self.looks = tuple(new), moves, None, 0
        self.changes += 1
        # the first step at a new share is not timed: a batch of a new size pays for warming up (how much:
        # bench/balance/NOTES.md, "The first step at a new share"); timed, it made a rank look slow
        self.warm = False
        if len(self.timings) >= FIRST_LOOK:  # a rank's time per image depends on its share: measured afresh
            self.levels.append(tuple(sum(column) / len(self.timings) for column in zip(*self.timings))[:2])
        self.timings.clear()
        return True


def fit(levels):
    """(seconds a step takes whatever its images, seconds an image), fitted by least squares to
    `levels`, (images, seconds of compute) a step at different shares; None if their shares are
    too close (within SPAN of their mean, or 4 images) to tell the two apart, or the line is not a
    cost: more images in less time. A step's own cost is held between none and half the largest
    level's compute (the least-squares line with its own cost at that bound): timings are noisy,
    and a rank's speed also moves with what else its server runs. Half of the largest level's
    compute, not the last's: at a share of a few images a step's own cost is most of it. Held, not
    given up: a fit that gave up left the rank's codes on the guess OWN_COST (under a quota a
    rank's own cost can fit below none; what that cost: bench/balance/NOTES.md).

    Why: a step has a cost of its own besides its images (measured: a rank's images per second
    fall as its share shrinks, bench/balance/NOTES.md). Speeds taken as images over seconds make a rank
    given more images look faster, and the shares creep to their balance over many reviews."""
    if len(levels) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in levels), statistics.fmean(y for _, y in levels)
    if max(x for x, _ in levels) - min(x for x, _ in levels) < max(4, SPAN * mx):
        return None
    per_image = sum((x - mx) * (y - my) for x, y in levels) / sum((x - mx) ** 2 for x, _ in levels)
    if per_image <= 0:
        return None
    fitted = my - per_image * mx
    per_step = min(max(0.0, fitted), max(y for _, y in levels) / 2)
    if per_step != fitted:
        per_image = sum(x * (y - per_step) for x, y in levels) / sum(x * x for x, _ in levels)
    return (per_step, per_image) if per_image > 0 else None


def stretched(history, cores):
    """Own seconds over CPU seconds, over steps of a rank's history, and at least what a quota of
    `cores` holds it to (quota_stretch): under a quota, a few steps that ran on saved-up quota,
    or that met a stall, are no change of speed (they flipped the shares back and forth)."""
    compute_cpu, compute, rest_cpu, rest, _ = (sum(column) for column in zip(*history))
    return max(quota_stretch(history, cores), (compute + rest) / max(compute_cpu + rest_cpu, 1e-9))


def quota_stretch(history, cores):
    """The least stretch a CPU quota of `cores` (None: none) allows over steps of a rank's history:
    its process's CPU time over the quota, against its work's CPU time."""
    compute_cpu, _, rest_cpu, _, process_cpu = (sum(column) for column in zip(*history))
    return process_cpu / cores / max(compute_cpu + rest_cpu, 1e-9) if cores else 0.0
