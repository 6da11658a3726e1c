"""--balance's lean (utils/lean.py, utils/balance.py): slower ranks solved as slower still, rank
0's search for the lean of the shortest step, and the lean's restart at a change of speed."""

from utils import balance
from utils.balance import REVIEW, Balance, solve, speed_code
from utils.lean import FIRST_TRIES, QUIET, SEARCH, LeanSearch, leaned_codes


def code(per_second):
    return speed_code(per_second, 1.0)


def test_a_lean_solves_slower_ranks_as_slower_still_and_never_below_code_1():
    fast, half, quarter = 160, 144, 128  # 16 codes: half the rate
    assert leaned_codes([fast, half, quarter], 0) == [fast, half, quarter]
    assert leaned_codes([fast, half, quarter], 8) == [fast, 128, 96]  # solved as a quarter, a sixteenth
    assert leaned_codes([fast, half, quarter], 1) == [fast, 142, 124]
    assert leaned_codes([fast, 3], 8) == [fast, 1]


def search_over(step_seconds, steps, search=None):
    """Rank 0's LeanSearch (a new one by default) over `steps` steps whose time depends on the lean
    in force (the one its sums carried at the review before): the lean in force after each review."""
    search = search or LeanSearch(REVIEW)
    clock, in_force, history = 0.0, search.lean, []
    for step in range(1, steps + 1):
        clock += step_seconds(in_force)
        search.timed(step, clock)
        if step % REVIEW == 0:  # the review: every rank solves with the lean rank 0 sent
            in_force = search.lean
            history.append(in_force)
    return history


def test_rank_0_finds_the_lean_of_the_shortest_step_and_tries_around_it_now_and_then():
    history = search_over(lambda lean: 0.06 * (1 + 0.05 * (lean - 4) ** 2), 1200)
    assert history[:4] == [0, 2, 4, 6]  # measured at 0 first, then two further every review while shorter
    assert history[4:8] == [4, 4, 4, 4]  # 6 was longer: back, and from now on one notch every SEARCH steps
    settled = history[10:]
    assert settled.count(4) >= 0.7 * len(settled) and set(settled) <= {3, 4, 5}  # a try now and then


def test_a_lean_that_makes_no_step_shorter_is_taken_back():
    history = search_over(lambda lean: 0.06, 600)
    assert history.count(0) >= 0.7 * len(history) and set(history) <= {0, 1, 2}  # never below 0


def test_every_rank_solves_with_rank_0s_lean_and_a_new_lean_moves_the_shares_at_once():
    ranks = [Balance("measured", rank=r, world_size=2, global_batch=64) for r in range(2)]
    over = code(10**6)
    codes = (code(1000), code(500), over, over, 0, 0)
    assert not any(b.review(REVIEW, codes) for b in ranks)  # a first look
    assert all(b.review(2 * REVIEW, codes) and b.shares() == [43, 21] for b in ranks)
    assert not any(b.review(3 * REVIEW, codes) for b in ranks)
    leaned = (*codes[:4], 1, 0)  # rank 0 tries a lean of 1: rank 1 solved 2 codes slower
    assert all(b.review(4 * REVIEW, leaned) and b.shares() == [44, 20] for b in ranks)  # 1 image, at once: taken


def test_a_slowdown_is_solved_at_once_with_the_parting_lean_and_rank_0_searches_down_from_it():
    """Speeds that part at a look where a rank saw its speed change (a slowdown has begun): every
    rank solves with PARTED_LEAN at that look, and rank 0's search starts there and tries less."""
    ranks = [Balance("measured", rank=r, world_size=2, global_batch=64) for r in range(2)]
    over = code(10**6)
    equal, slow = (code(1000), code(1000) - 2, over, over, 0, 0), (code(1000), code(500), over, over, 0, 1)
    assert not any(b.review(REVIEW, equal) for b in ranks)  # about equal: held
    leaned = solve(64, leaned_codes(slow[:2], balance.PARTED_LEAN), slow[2:4])
    assert leaned[1] < solve(64, slow[:2], slow[2:4])[1]  # (solved as slower than it measured)
    assert all(b.review(2 * REVIEW, slow) and b.shares() == leaned for b in ranks)  # at once, alike
    assert all(b.lean == balance.PARTED_LEAN for b in ranks)
    search = ranks[0].search
    assert search.lean == balance.PARTED_LEAN and search.direction == -1 and search.quick
    # the next looks carry rank 0's lean: no new restart while no rank sees its speed change
    assert not any(b.review(3 * REVIEW, (*slow[:4], search.lean, 0)) for b in ranks)
    assert not any(b.review(4 * REVIEW, (*slow[:4], search.lean, 1)) for b in ranks)  # (nor as much apart)
    # the slowdown ends: the slow rank says so, and its speed is 8 codes nearer (still apart)
    nearer = (code(1000), code(500) + balance.LEAN_FROM, *slow[2:4], search.lean, 1)
    assert all(b.review(5 * REVIEW, nearer) for b in ranks)  # lean 0 at once
    assert all(b.lean == 0 and b.shares() == solve(64, nearer[:2], nearer[2:4]) for b in ranks)
    assert search.lean == 0 and search.direction == 1 and search.quick


def test_ranks_of_about_equal_speed_are_solved_with_no_lean_at_once():
    """Speeds within LEAN_FROM codes: no lean from that look on, whatever rank 0's sums last carried
    (its search lets the lean go at the same look, and sends 0 from the next step)."""
    b = Balance("measured", rank=1, world_size=2, global_batch=64)
    over = code(10**6)
    b.review(REVIEW, (code(1000), code(500), over, over, 0, 0))
    assert b.review(2 * REVIEW, (code(1000), code(500), over, over, 4, 0)) and b.lean == 4  # rank 0's lean
    together = (code(1000), code(1000) - 2, over, over, 4, 0)
    assert b.review(3 * REVIEW, together) and b.lean == 0 and b.shares() == solve(64, together[:2], together[2:4])


def test_speeds_that_part_with_no_change_seen_are_solved_with_no_lean():
    """At the start of a run (no rank saw its speed change: it has been as it is from the first
    step) the first solve is leanless, and moves after two looks as ever."""
    b = Balance("measured", rank=0, world_size=2, global_batch=64)
    codes = (code(1000), code(500), code(10**6), code(10**6), 0, 0)
    assert not b.review(REVIEW, codes) and b.lean == 0 and b.search.lean == 0
    assert b.review(2 * REVIEW, codes) and b.shares() == [43, 21]


def test_a_search_from_the_parting_lean_goes_down_while_steps_get_shorter():
    def from_parted(step_seconds, steps):
        search = LeanSearch(REVIEW)
        search.hold(False, restart=balance.PARTED_LEAN)
        return search_over(step_seconds, steps, search)

    history = from_parted(lambda lean: 0.06 * (1 + 0.05 * (lean - 2) ** 2), 200)
    start, tries = balance.PARTED_LEAN, balance.PARTED_LEAN // 2 + 1
    assert history[:tries] == list(range(start, -1, -2))  # measured where it started, then 2 lower a look
    assert set(history[tries:]) <= {1, 2, 3}  # 0 was no shorter than 2: back to 2, one notch at a time
    history = from_parted(lambda lean: 0.06 * (1 + 0.05 * (lean - start) ** 2), 200)
    assert history[:3] == [start, start - 2, start]  # less was longer: back at once


def test_a_lean_that_moves_no_share_is_no_try_so_it_cannot_wander_on_noise():
    b = Balance("measured", rank=0, world_size=2, global_batch=64)
    apart = (code(1000), code(1000) - 10, code(200), code(200))  # (10 codes: a lean of 1 moves nothing)
    assert not b.review(REVIEW, (*apart, 0, 0)) and b.review(2 * REVIEW, (*apart, 0, 0)) and b.shares() == [39, 25]
    b.search.trying = 1  # (its decision at the step before the review; its lean rode with the sum)
    assert not b.review(3 * REVIEW, (*apart, 1, 0)) and b.shares() == [39, 25]
    assert b.search.lean == 0 and b.search.quiet == QUIET


def test_no_lean_is_tried_between_ranks_of_about_equal_speed_and_one_is_once_they_part():
    b = Balance("measured", rank=0, world_size=2, global_batch=64)
    over = code(10**6)

    def leans(slow, steps):
        seen = set()
        for step in range(steps):
            b.review(step, (code(1000), slow, over, over, b.search.lean, 0))
            seen.add(b.search.lean)
        return seen

    assert leans(code(1000) - balance.LEAN_FROM + 1, 20 * SEARCH) == {0}  # noise would steer it
    parted = leans(code(1000) - balance.LEAN_FROM, 2 * SEARCH)
    assert {0, FIRST_TRIES} <= parted  # they part: a search at once, in strides (on this clock's noise)
    assert leans(code(1000), 2 * SEARCH) == {0}  # together again: the lean is let go
