"""bench/balance/balance_change.py: when a change counts as balanced, on reviews made up here."""

import balance_change
from balance_change import followed, summary

STEPS = list(range(5, 501, 5))  # rank 0 reviews every 5 steps


def test_a_change_is_balanced_when_two_windows_after_it_are_within_10_percent_of_the_settled_pace():
    # a slowdown at step 100.5: the windows ending at 105 and 110 are slow, from 115 on 30 ms;
    # the 100 steps before step 300 hold 30 ms, so the windows ending 115 and 120 are the first pair
    pace = [None] + [60.0 if st in (105, 110) else 30.0 for st in STEPS[1:]]
    shares = [32 if st <= 100 else 6 for st in STEPS]
    c = followed(STEPS, shares, pace, 100.5, 300)
    assert c["steps"] == 14.5 and c["settled"] == 6 and c["settled_ms"] == 30.0
    assert c["steps_to_band"] == 4.5  # rank 1's share is 6 from the review at step 105


def test_a_window_that_began_before_the_change_does_not_count_and_one_slow_window_breaks_a_pair():
    pace = [None] + [30.0] * (len(STEPS) - 1)
    pace[STEPS.index(115)] = 34.0  # 13% over
    c = followed(STEPS, [6] * len(STEPS), pace, 100.5, 300)
    assert c["steps"] == 19.5  # not 105 (its window began before the change), nor 110 or 115 (115's is slow)


def test_a_change_never_balanced_says_so():
    pace = [None] + [30.0 if 200 < st <= 300 else 45.0 for st in STEPS[1:]]
    c = followed(STEPS, [6] * len(STEPS), pace, 300.5, 500)  # settled on steps 401-500: 45 ms, all after
    assert c["steps"] == 9.5
    assert followed(STEPS, [6] * len(STEPS), pace, 100.5, 500)["steps"] == 9.5  # the steps after 300 pass
    wavering = [None] + [30.0 if st % 10 else 40.0 for st in STEPS[1:]]  # median 35: every other window 14% over
    assert followed(STEPS, [6] * len(STEPS), wavering, 100.5, 300)["steps"] is None  # no two in a row


def test_the_summary_counts_a_never_as_the_slowest_and_as_not_within_20():
    assert summary([10, 30, None]) == "30 (20-never), 1 of 3 within 20"
    assert summary([9.6, 9.2]) == "9 (9-10), 2 of 2 within 20"
    assert summary([14.5]) == "14 (14-14), 1 of 1 within 20"


def test_the_report_shows_the_floor_and_another_revision_beside_balance_and_the_target_is_balances_alone():
    def run(start, end):
        return dict(changed_at=[dict(step=100.5, settled_ms=30, steps=start, settled=6, band=[4, 8],
                                     steps_to_band=9.5, steps_to_near=9.5),
                                dict(step=300.5, settled_ms=22, steps=end, settled=32, band=[29, 35],
                                     steps_to_band=9.5, steps_to_near=9.5)])  # fmt: skip

    result = dict(runs=[run(24, 15), run(30, 14)], floor={"56:8": [run(10, 80)], "32:32": [run(90, 9)]})
    result["against"] = {"--balance at abc123": [run(40, None)]}
    text = "\n".join(balance_change.report(result))
    assert "| --balance at abc123 | 40 (40-40), 0 of 1 within 20 | never (never-never), 0 of 1 within 20 |" in text
    assert "| --balance | 27 (26-28), 0 of 2 within 20 | 14 (14-15), 2 of 2 within 20 |" in text
    assert "| the floor: fixed 56:8 | 10 (10-10), 1 of 1 within 20 |  |" in text  # the start only
    assert "| the floor: fixed 32:32 |  | 9 (9-9), 1 of 1 within 20 |" in text  # the end only
    name, measured, ok = balance_change.target(result)
    assert measured == "24, 15, 30, 14" and not ok
