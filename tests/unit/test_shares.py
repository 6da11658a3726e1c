"""--balance's pure parts (utils/balance/shares.py): speeds as codes, shares from codes, the reviews, and
each step's images cut by the shares of the moment (utils/data.BalancedBatches); and, without
--balance, the hint that names a slow rank (utils/report.SlowRankHint)."""

import math
import time

import pytest
import torch

from utils.balance import shares as balance
from utils.balance.shares import REVIEW, WINDOW, Balance, code_value, own_clock, shares_of, solve, speed_code
from utils.learn.data import BalancedBatches, epoch_permutation
from utils.observe.report import SlowRankHint
from utils.sync.interface import waited_since


def test_speed_codes_are_exact_small_whole_numbers():
    assert speed_code(0, 1.0) == 0  # nothing measured
    assert speed_code(5, 0.0) == balance.MAX_CODE  # no time at all: as fast as a code says
    assert speed_code(64, 0.05) == round(16 * math.log2(1280))
    assert speed_code(1, 1e9) == 1 and speed_code(10**12, 1e-3) == balance.MAX_CODE  # clamped
    codes = [speed_code(n, 1.0) for n in (100, 200, 400, 800)]
    assert [b - a for a, b in zip(codes, codes[1:])] == [16, 16, 16]  # 16 codes per doubling
    for code in range(1, balance.MAX_CODE + 1):  # exact in bfloat16, the narrowest wire format
        assert torch.tensor(float(code), dtype=torch.bfloat16).item() == code
        assert float(code_value(code)) == pytest.approx(2 ** (code / 16), rel=1e-5)
    assert all(code_value(c) < code_value(c + 1) for c in range(1, balance.MAX_CODE))


def code(per_second):
    return speed_code(per_second, 1.0)


@pytest.mark.parametrize(
    "rates, overheads, expected",
    [
        ((1000, 1000), (200, 200), [32, 32]),  # alike: equal shares
        ((1000, 500), (10**6, 10**6), [43, 21]),  # no overhead: shares in proportion to the rates
        ((1000, 500), (200, 100), [44, 20]),  # 5 and 10 ms a step: 44.3 / 1000 + 5 ms = 19.7 / 500 + 10 ms
        ((1000, 1), (200, 200), [63, 1]),  # at least one image each
        ((600, 400, 300, 200), (10**6,) * 4, [26, 17, 13, 8]),
    ],
)
def test_shares_give_every_rank_the_same_step_time(rates, overheads, expected):
    shares = solve(64, [code(r) for r in rates], [code(o) for o in overheads])
    assert shares == expected and sum(shares) == 64


def test_the_shares_are_within_an_image_of_equal_step_times():
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(2, 9, (1,), generator=generator))
        rates = [int(c) for c in torch.randint(100, 200, (n,), generator=generator)]
        overheads = [int(c) for c in torch.randint(80, 200, (n,), generator=generator)]
        shares = solve(256, rates, overheads)
        assert sum(shares) == 256 and min(shares) >= 1
        times = [1 / code_value(o) + s / code_value(r) for s, r, o in zip(shares, rates, overheads)]
        free = [t for t, s in zip(times, shares) if s > 1]  # (a rank held at one image is faster)
        slowest_image = max(1 / code_value(r) for r in rates)
        assert max(free) - min(free) <= 2 * slowest_image, (shares, rates, overheads)


@pytest.mark.parametrize(
    "size, weights, expected",
    [
        (64, (1, 1), [32, 32]),
        (64, (2, 1), [43, 21]),  # 42.67 / 21.33: the larger remainder gets the image left over
        (65, (1, 1), [33, 32]),  # a tie: the lower rank first
        (64, (6, 4, 3, 2), [26, 17, 13, 8]),
        (5, (1000, 1, 1, 1), [2, 1, 1, 1]),  # every rank at least one image...
        (3, (1, 1, 1, 1), [1, 1, 1, 0]),  # ...when there are as many images as ranks
    ],
)
def test_shares_are_proportional_whole_numbers(size, weights, expected):
    assert shares_of(size, weights) == expected


def test_shares_cover_the_step_for_any_weights():
    generator = torch.Generator().manual_seed(0)
    for _ in range(500):
        n = int(torch.randint(1, 9, (1,), generator=generator))
        weights = [int(c) for c in torch.randint(1, 1000, (n,), generator=generator)]
        size = int(torch.randint(1, 300, (1,), generator=generator))
        shares = shares_of(size, weights)
        assert sum(shares) == size and len(shares) == n
        assert min(shares) >= (1 if size >= n else 0)
        exact = [size * w / sum(weights) for w in weights]
        assert all(abs(s - e) < 1 for s, e in zip(shares, exact)) or min(exact) < 1


def one_share(per_second, overhead=0.005, stretch=1.0, images=32):
    """The rate and overhead codes of a rank timed at one share only (timed()): with no fit yet, a
    step's own cost is taken as OWN_COST of its compute, and the rest of it as its images'."""
    compute = images / per_second
    per_image, per_step = (1 - balance.OWN_COST) * compute / images, balance.OWN_COST * compute
    return code(1 / (per_image * stretch)), code(1 / (overhead * stretch + per_step * stretch))


def past_first_look(b):
    """`b` (a Balance of a new group) after its first look, which found its ranks alike: from then
    on a review comes every REVIEW steps and a move takes two looks."""
    n = b.world_size
    assert not b.review(1, (code(1000),) * n + (code(10**6),) * n + (0,)) and not b.fresh
    return b


def timed(b, per_second, overhead=0.005, steps=WINDOW, stretch=1.0):
    """Steps of 32 images at `per_second` of CPU, their forward and backward `stretch` times longer
    on the rank's own clock; then `overhead` seconds of CPU (and 1 s of waiting)."""
    for _ in range(steps):
        step(b, 32, 32 / per_second, overhead, stretch)


def step(b, images, compute_cpu, overhead=0.005, stretch=1.0):
    """One step, as timed() gets it: the clocks of start() (own clock, the training thread's CPU
    time, process CPU s) at its start, and of now() (the same, but utils/cpu.snapshot: process CPU
    s, waited s, stalled s, clock) after its backward and at its end."""
    b.timed(
        images,
        (0.0, 0.0, 0.0),
        (compute_cpu * stretch, compute_cpu, (compute_cpu, 0.0, 0.0, 0.0)),
        (compute_cpu * stretch + 1.0, compute_cpu, (compute_cpu + overhead, 0.0, 0.0, 1.0)),
    )


def test_a_rank_sends_its_codes_in_its_own_slots_once_it_has_measured_enough():
    b = Balance("measured", rank=1, world_size=3, global_batch=64)
    assert b.slots() == (0,) * 7
    timed(b, 10.0, steps=1)  # the first step pays for warming up: not timed
    timed(b, 1000.0, steps=balance.FIRST_LOOK - 1)
    assert b.slots() == (0,) * 7  # not enough steps yet
    timed(b, 1000.0, steps=1)
    rate, overhead = one_share(1000.0)
    assert b.slots() == (0, rate, 0, 0, overhead, 0, 0)  # rate, then overhead; no change said
    past_first_look(b)  # after a new group's first look, MEASURED steps at the current shares
    b.timings.clear()
    timed(b, 1000.0, steps=balance.MEASURED - 1)
    assert b.slots() == (0,) * 7
    timed(b, 1000.0, steps=1)
    assert b.slots() == (0, rate, 0, 0, overhead, 0, 0)
    timed(b, 500.0, 0.01)  # the window holds only the last WINDOW steps
    rate, overhead = one_share(500.0, 0.01)
    assert b.slots() == (0, rate, 0, 0, overhead, 0, 0)


def test_shares_change_only_at_a_review_with_every_speed_and_past_the_threshold():
    b = Balance("measured", rank=0, world_size=2, global_batch=64)
    fast, slow, over = code(1000), code(500), code(10**6)
    assert not b.review(1, (fast, 0, over, over, 0)) and b.fresh  # a rank not measured yet: no look
    past_first_look(b)
    assert not b.review(REVIEW - 1, (fast, slow, over, over, 0)) and b.shares() == [32, 32]  # not a review step
    assert not b.review(REVIEW, (fast, 0, over, over, 0)) and b.shares() == [32, 32]  # a rank not measured yet
    assert not b.review(2 * REVIEW, (fast, slow, over, over, 0)) and b.shares() == [32, 32]  # a first look
    assert not b.review(3 * REVIEW, (fast, fast, over, over, 0))  # the next does not want it: a slow spell
    assert not b.review(4 * REVIEW, (fast, slow, over, over, 0)) and b.shares() == [32, 32]
    assert b.review(5 * REVIEW, (fast, slow, over, over, 0)) and b.shares() == [43, 21] and b.changes == 1
    assert not b.review(6 * REVIEW, (fast, slow - 1, over, over, 0))  # 4% slower: noise, no flapping
    assert not b.review(7 * REVIEW, (fast, slow - 1, over, over, 0))  # (not even at a second look)
    assert b.shares() == [43, 21] and b.changes == 1
    assert not b.review(8 * REVIEW, (fast, fast, over, over, 0))
    assert b.review(9 * REVIEW, (fast, fast, over, over, 0)) and b.shares() == [32, 32]
    assert b.shares(7) == [4, 3]  # a smaller last step, cut in the same proportions


def test_under_sync_every_a_look_waits_for_the_codes_of_the_rounds_sum():
    """--sync-every H sums once a round: the steps between bring no codes (()), and the look that a
    REVIEW step asks for comes with the next codes, one look per arrival."""
    b = past_first_look(Balance("measured", rank=0, world_size=2, global_batch=64))
    codes = (code(1000), code(500), code(10**6), code(10**6), 0)
    assert not b.review(REVIEW, ()) and not b.review(REVIEW + 1, ())  # no codes: the look waits
    assert not b.review(REVIEW + 3, codes) and b.shares() == [32, 32]  # the round's codes: a first look
    assert not b.review(REVIEW + 4, codes)  # (no REVIEW step since: no look, not even at codes)
    assert not b.review(2 * REVIEW, ()) and not b.review(2 * REVIEW + 2, ())
    assert b.review(2 * REVIEW + 3, codes) and b.shares() == [43, 21]  # the next round's: a second look


def test_a_new_group_starts_from_equal_shares_and_keeps_its_own_timings():
    b = Balance("measured", rank=0, world_size=2, global_batch=64)
    timed(b, 800.0)
    over = code(10**6)
    assert b.review(1, (code(800), code(400), over, over, 0)) and b.shares() == [43, 21]
    timed(b, 800.0, steps=balance.MEASURED + 1)  # (new shares are measured afresh, from their second step)
    b.restart(1, 3)
    rate, overhead = one_share(800.0)
    assert b.shares() == [22, 21, 21] and b.slots() == (0, rate, 0, 0, overhead, 0, 0)
    b.restart(0, 2, weights=(43, 21))  # a resume: the checkpoint's shares
    assert b.shares() == [43, 21]


def test_a_new_groups_first_look_comes_once_every_rank_has_timed_its_first_steps_and_moves_alone():
    """Every step at equal shares keeps the fast ranks waiting: a new group waits neither for a
    REVIEW step nor for a second look to take its first shares. That move is solved on a guess of a
    step's own cost (OWN_COST); the next look, on a fitted one, moves 2 images either way, no GAIN."""
    b = Balance("measured", rank=0, world_size=2, global_batch=64)
    over = code(10**6)

    def codes(slow):
        return (code(1000), code(slow), over, over, 0)

    timed(b, 10.0, steps=1)  # (not timed)
    timed(b, 1000.0, steps=balance.FIRST_LOOK)
    assert b.slots()[0] == one_share(1000.0)[0]
    assert b.review(3, codes(500)) and b.shares() == [43, 21] and not b.fresh  # step 3: one look
    assert not b.review(4, codes(620)) and b.shares() == [43, 21]  # then reviews every REVIEW steps
    assert not b.review(REVIEW, (code(1000), 0, over, over, 0))  # (rank 1 not yet timed at 21 images)
    assert b.review(2 * REVIEW, codes(561)) and b.shares() == [41, 23]  # 2 back, 5% shorter: one look
    assert b.review(3 * REVIEW, codes(700)) and b.shares() == [37, 27]  # on in its direction: one look
    assert not b.review(4 * REVIEW, codes(500))  # back: two looks and a gain
    b.restart(0, 2)  # a lost rank or a join: a new group, whose speeds are to be learnt
    assert b.fresh and b.shares() == [32, 32]
    b.restart(0, 2, weights=(43, 21))  # a resume: the checkpoint's shares
    assert not b.fresh and not b.review(3, codes(500))


def test_fixed_proportions_never_change_and_hold_only_for_their_number_of_ranks():
    b = Balance("5:2", rank=0, world_size=2, global_batch=64)
    assert b.shares() == [46, 18] and b.slots() == ()
    timed(b, 100.0)
    assert not b.review(REVIEW, (200, 100, 100, 100, 0)) and b.shares() == [46, 18]
    b.restart(0, 3)  # after a lost rank or a join: equal shares
    assert b.shares() == [22, 21, 21]
    b.restart(0, 2)
    assert b.shares() == [46, 18]


@pytest.mark.parametrize("num_examples, global_batch", [(1000, 64), (960, 64), (70, 64), (10, 7)])
def test_balanced_batches_train_every_image_once_whatever_the_shares_do(num_examples, global_batch):
    """Three ranks whose shares change at different steps (the same changes on every rank, as the
    sum makes them): together they take every image of the epoch once, in the epoch's order, and
    the weights make the average count every image alike."""
    n, epoch, seed = 3, 2, 5
    ranks = [Balance("measured", r, n, global_batch) for r in range(n)]
    views = [BalancedBatches(num_examples, epoch, seed, global_batch, b) for b in ranks]
    changes = {1: (3, 1, 1), 4: (1, 5, 2), 9: (30, 20, 14)}
    seen = []
    for step in range(len(views[0])):
        for b in ranks:
            b.weights = changes.get(step, b.weights)
        parts = [view[step] for view in views]
        size = parts[0][2]
        assert all(p[2] == size for p in parts) and sum(len(p[0]) for p in parts) == size
        assert sum(p[1] for p in parts) == pytest.approx(n)  # each weight: its share of the step times N
        seen += [i for p in parts for i in p[0].tolist()]
    assert seen == epoch_permutation(num_examples, epoch, seed).tolist()


def test_unless_it_follows_a_change_a_move_takes_two_looks_and_a_gain_or_persist_looks():
    """A rank's CPU time for the same images moves by 15% and more for 10-30 steps while nothing
    changes (bench/balance/NOTES.md): equal servers' shares followed it. A move is made only where the
    codes say a step at the new shares is GAIN shorter than at the old, or PERSIST looks in a
    row want it (a smaller gain: a 2-rank job's steps took 5% longer 3 images from its best split)."""
    b = past_first_look(Balance("measured", rank=0, world_size=2, global_batch=64))
    over = code(10**6)

    def codes(slow):
        return (code(1000), code(slow), over, over, 0)

    assert not b.review(REVIEW, codes(750)) and not b.review(2 * REVIEW, codes(750))  # 36:28: 11% shorter
    assert b.shares() == [32, 32]
    assert not b.review(3 * REVIEW, codes(500)) and b.review(4 * REVIEW, codes(500)) and b.shares() == [43, 21]
    persist = balance.PERSIST
    for k in range(5, 4 + persist):  # 45:19 would make a step 10% shorter: not worth a move...
        assert not b.review(k * REVIEW, codes(420)) and b.shares() == [43, 21]
    assert b.review((4 + persist) * REVIEW, codes(420)) and b.shares() == [45, 19]  # ...unless PERSIST looks want it
    assert not b.review((5 + persist) * REVIEW, codes(1000))  # back (a quarter shorter), at a first look
    assert b.review((6 + persist) * REVIEW, codes(1000)) and b.shares() == [32, 32]
    for look in range(3 * persist):  # PERSIST - 1 looks want a small move one way, then one the other way
        slow = 1300 if look % persist else 750
        assert not b.review((7 + persist + look) * REVIEW, codes(slow)) and b.shares() == [32, 32]


def test_the_first_step_at_new_shares_is_not_timed():
    """A batch of a new size pays for warming up (measured: a third longer than the steps after
    it); timed, it made a rank look slow at the next look, and the shares moved back."""
    b = Balance("measured", rank=0, world_size=2, global_batch=64)
    timed(b, 1000.0, steps=balance.MEASURED + 1)
    over = code(10**6)
    assert b.review(REVIEW, (code(1000), code(500), over, over, 1)) and b.shares() == [43, 21]
    step(b, 43, 0.5)
    assert not b.timings  # not timed
    for _ in range(balance.MEASURED):
        step(b, 43, 0.043)
    assert [t[:2] for t in b.timings] == [(43, 0.043)] * balance.MEASURED
    b.restart(0, 3)  # a new group: new shares too
    step(b, 22, 0.5)
    assert len(b.timings) == balance.MEASURED


def test_a_ranks_own_clock_counts_its_work_and_leaves_out_its_waits_for_the_others():
    started = own_clock()
    time.sleep(0.1)  # its own work, or a stall that held it back: counted
    computed = own_clock()
    waiting = time.perf_counter()
    time.sleep(0.3)  # waiting for a slower rank's part of the sum: not counted
    waited_since(waiting)  # (how every sum's wait is counted: utils/sync/interface.py)
    ended = own_clock()
    assert computed - started >= 0.1
    assert abs(ended - computed) < 0.05


def test_a_changed_speed_leaves_the_older_steps_out_of_its_stretch():
    b = Balance("measured", rank=0, world_size=2, global_batch=64)
    timed(b, 1000.0, steps=balance.HISTORY)
    timed(b, 1000.0, steps=balance.RECENT, stretch=1.2)  # 20% longer on its own clock: noise
    assert len(b.history) == balance.HISTORY
    timed(b, 1000.0, steps=balance.RECENT // 2, stretch=3.0)  # a quota, or another job: 3 times longer
    assert len(b.history) < balance.HISTORY  # the older steps are forgotten
    stretch, _ = b.stretch()
    assert stretch > 2.0 and b.slots()[0] == one_share(1000.0, stretch=stretch)[0]  # CPU speed over the stretch


class QuotaGroup:
    """A CpuGroup of a CPU quota of `cores` cores that has stalled nothing yet."""

    def __init__(self, cores):
        self.quota = cores

    def cores(self):
        return self.quota

    def stalled(self):
        return 0.0


def test_a_rank_under_a_quota_is_measured_at_no_more_than_a_part_of_what_the_quota_allows():
    b = Balance("measured", rank=0, world_size=2, global_batch=64)
    b.group = QuotaGroup(0.5)
    timed(b, 1000.0, overhead=0.008)  # its steps ran at full speed: it had saved up quota
    least = 2.0 / balance.QUOTA_USE  # half a core: twice its CPU time on average, solved to use QUOTA_USE of it
    assert b.stretch() == pytest.approx((least, least))
    rate, overhead = one_share(1000.0, 0.008, stretch=least)
    assert b.slots()[:4] == (rate, 0, overhead, 0)
    b.group = QuotaGroup(4.0)  # a quota that does not hold it back
    timed(b, 1000.0, overhead=0.008, steps=2)  # (the step it is seen in is forgotten with the older ones)
    assert b.stretch() == pytest.approx((1.0, 1.0))
    b.group = QuotaGroup(None)  # the quota is lifted
    timed(b, 1000.0, overhead=0.008, steps=2)
    rate, overhead = one_share(1000.0, 0.008)
    assert b.stretch() == pytest.approx((1.0, 1.0)) and b.slots()[:4] == (rate, 0, overhead, 0)


def test_under_a_quota_steps_on_saved_up_quota_are_no_change_of_speed_and_another_job_is():
    """A rank under a quota runs fast while it has quota left, then stalls: a few steps' stretch
    says little of its speed; the quota holds it to its process's CPU time over the quota."""
    b = Balance("measured", rank=0, world_size=2, global_batch=64)
    b.group = QuotaGroup(0.5)
    timed(b, 1000.0, steps=balance.HISTORY + 1, stretch=2.0)  # half a core: twice its CPU time
    timed(b, 1000.0, steps=balance.RECENT)  # then steps that met no stall
    assert b.slots()[-1] == 0 and len(b.history) == balance.HISTORY  # no change: the quota is the same
    timed(b, 1000.0, steps=balance.RECENT, stretch=4.0)  # another job takes its CPU
    assert b.slots()[-1] == 1 and len(b.history) < balance.HISTORY
    free = Balance("measured", rank=0, world_size=2, global_batch=64)  # the same steps with no quota
    timed(free, 1000.0, steps=balance.HISTORY + 1, stretch=2.0)
    timed(free, 1000.0, steps=balance.RECENT)  # another job ended
    assert free.slots()[-1] == 1


def test_new_shares_are_measured_afresh_and_a_step_of_any_size_costs_its_own_time():
    b = Balance("measured", rank=1, world_size=2, global_batch=64)
    over, cost = code(10**6), lambda images: 0.010 + images * 0.001  # 10 ms a step, 1 ms an image
    for _ in range(WINDOW):
        step(b, 32, cost(32))
    rate, overhead = one_share(32 / cost(32))
    assert b.slots()[:4] == (0, rate, 0, overhead)  # one share: OWN_COST of its compute a step's own
    past_first_look(b)
    assert not b.review(REVIEW, (code(1000), code(500), over, over, 0))
    assert b.review(2 * REVIEW, (code(1000), code(500), over, over, 0)) and b.shares() == [43, 21]
    assert b.slots()[:4] == (0, 0, 0, 0)  # nothing measured at the new shares yet
    for _ in range(balance.MEASURED + 1):  # (the first at a new share is not timed)
        step(b, 21, cost(21))
    assert b.slots()[:4] == (0, code(1000), 0, code(1 / 0.015))  # two shares: 1 ms an image, 10 + 5 ms a step
    assert balance.fit([(32, 0.042), (31, 0.041)]) is None  # shares too close to tell the two apart
    assert balance.fit([(32, 0.030), (21, 0.035)]) is None  # noise: more images took less time
    # a step's own cost held between none and half the compute (under a quota: fitted below none)
    per_step, per_image = balance.fit([(32, 0.0172), (13, 0.006)])
    assert per_step == 0 and per_image == pytest.approx((32 * 0.0172 + 13 * 0.006) / (32**2 + 13**2))
    per_step, per_image = balance.fit([(32, 0.040), (8, 0.036)])  # 34.7 ms a step's own: held at 20
    assert per_step == pytest.approx(0.020) and per_image == pytest.approx((32 * 0.020 + 8 * 0.016) / (32**2 + 8**2))


def test_a_small_share_keeps_its_steps_own_cost_and_the_last_good_fit_stays():
    b = Balance("measured", rank=1, world_size=2, global_batch=64)
    b.levels.append((32, 0.042))  # 10 ms a step, 1 ms an image
    for _ in range(WINDOW):
        step(b, 8, 0.018)  # at 8 images the step's own cost is more than half the compute
    rate = code(8 / 0.009)  # the step's own cost taken out, at most half its compute: not 8 / 18 ms
    assert b.slots()[1] == rate and b.cost == pytest.approx((0.010, 0.001))
    b.levels.clear()  # (as after a change of speed): nothing to fit on, the last fit stands
    assert b.slots()[1] == rate


def test_a_rank_that_saw_its_speed_change_says_so_and_one_look_moves_the_shares():
    b = Balance("measured", rank=0, world_size=2, global_batch=64)
    timed(b, 1000.0, steps=balance.HISTORY)
    assert b.slots()[-1] == 0
    timed(b, 1000.0, steps=balance.RECENT // 2, stretch=3.0)  # a quota came
    assert b.slots()[-1] == 1
    over = code(10**6)
    slower = code(1000) - 7
    assert b.review(REVIEW, (code(1000), slower, over, over, 1)) and b.shares() == [37, 27]  # one look
    assert b.slots()[-1] == 0  # said once


def test_after_a_change_of_speed_a_move_on_in_its_direction_takes_one_look():
    b = Balance("measured", rank=0, world_size=2, global_batch=64)
    over = code(10**6)

    def codes(slow, changed=0):
        return (code(1000), code(slow), over, over, changed)

    assert b.review(REVIEW, codes(500, changed=1)) and b.shares() == [43, 21]  # a change: one look
    assert b.review(2 * REVIEW, codes(420)) and b.shares() == [45, 19]  # on in its direction: one look
    assert not b.review(3 * REVIEW, codes(1000))  # back: two looks, as ever; and the change is followed
    assert not b.review(4 * REVIEW, codes(250))  # so a move on takes two looks again (and must gain)
    assert b.review(5 * REVIEW, codes(250)) and b.shares()[1] < 19


def test_a_change_of_quota_is_a_change_of_speed():
    """A rank given an image or two under a quota is seldom stalled, so its stretch may not show the
    quota's end; the quota itself is read at every step, at its end."""
    b = Balance("measured", rank=0, world_size=2, global_batch=64)
    b.group = QuotaGroup(0.4)
    timed(b, 1000.0, steps=balance.HISTORY + 1)  # (the first is not timed)
    assert b.slots()[-1] == 0 and len(b.history) == balance.HISTORY
    b.group = QuotaGroup(None)  # lifted
    timed(b, 1000.0, steps=1)  # (the step it was seen in ran in part at the old quota)
    assert len(b.history) == 0 and b.slots()[:2] == (0, 0)  # nothing measured at the new speed yet
    timed(b, 1000.0, steps=1)
    assert b.slots()[-1] == 1 and len(b.history) == 1  # only the step since: the old quota's are forgotten
    stretch, _ = b.stretch()
    assert stretch == pytest.approx(1.0)


def test_the_slow_rank_hint_names_a_rank_that_kept_the_others_waiting_once_and_never_on_equals(capsys):
    def ranks(*computes, step=1.0):
        return [dict(compute_seconds=c, step_seconds=step) for c in computes]

    quiet = SlowRankHint(enabled=True)
    quiet.check(ranks(0.70, 0.72, 0.71), steps=200)  # equal servers: 2% apart
    quiet.check(ranks(0.50, 0.74), steps=200)  # kept waiting 24% of a step: not more than a quarter
    quiet.check(ranks(0.20, 0.90), steps=SlowRankHint.MIN_STEPS - 1)  # too few steps to tell
    SlowRankHint(enabled=False).check(ranks(0.20, 0.90), steps=200)  # not rank 0, or --balance
    assert capsys.readouterr().out == ""
    hint = SlowRankHint(enabled=True)
    hint.check(ranks(0.40, 0.90, 0.45), steps=200)
    hint.check(ranks(0.40, 0.90, 0.45), steps=200)  # the next epoch: said once only
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rank 1 kept the others waiting for 45% or more"), lines
    assert "2.0x as long" in lines[0] and "--balance" in lines[0], lines
