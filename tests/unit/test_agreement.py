"""The survivors' agreement (utils/elastic/agreement.py) over a fake network: no sockets, no torch.

Each case is one the recovery guide describes (docs/stopping-and-resuming.md, "When a server is
lost"). Every 50 ms of fake time each running member tells every other "recovering, my position";
a killed member's port refuses, a frozen or cut-off one is silent. Each member asks assess()
what to do with what it has heard; a leader's decision reaches the members it names.
"""

import pytest

from utils.elastic import agreement
from utils.elastic.agreement import State

TICK = 0.05


class FakeNetwork:
    """Members of generation 0 recovering at once. killed: refuse; frozen: silent and deaf;
    sides: groups that cannot hear each other (a cut link); positions: member -> [epoch, step]."""

    def __init__(self, members, positions, killed=(), frozen=(), sides=None, lost=None, heartbeat=2.0):
        self.members, self.positions, self.heartbeat = members, positions, heartbeat
        self.killed, self.frozen, self.sides = set(killed), set(frozen), sides or [members]
        self.running = [m for m in members if m not in self.killed | self.frozen]
        self.heard = {m: {} for m in members}  # listener -> {speaker: last time heard}
        self.reports = {m: {} for m in members}
        self.refused = {m: set() for m in members}
        self.named = {m: set() for m in members}
        self.lost = lost or {}  # member -> the member it saw go first
        for m in members:  # before the loss everyone heard everyone, the frozen ones a heartbeat ago
            self.heard[m] = {o: (-heartbeat if o in self.frozen else 0.0) for o in members}
        self.outcomes = {}

    def reach(self, a, b):
        return any(a in side and b in side for side in self.sides)

    def tick(self, now):
        for m in self.running:
            if m in self.outcomes:
                continue
            for other in self.members:
                if other == m:
                    continue
                if other in self.killed:
                    self.refused[m].add(other)
                elif other in self.running and self.reach(m, other):
                    self.heard[other][m] = now
                    self.reports[other][m] = self.positions[m]
                    if self.lost.get(m) is not None:
                        self.named[other].add(self.lost[m])
        for m in self.running:
            if m in self.outcomes:
                continue
            view = agreement.View(
                m,
                self.members,
                {**self.reports[m], m: self.positions[m]},
                {o: now - t for o, t in self.heard[m].items()},
                frozenset(self.refused[m]),
                self.lost.get(m),
                frozenset(self.named[m]),
                now,
                self.heartbeat,
            )
            outcome = agreement.assess(view)
            if outcome.action == "decide":
                decision = agreement.successor(self.members, outcome.reports)
                for member in decision[0]:
                    self.outcomes[member] = ("go on", decision)
            elif outcome.action == "give up":
                self.outcomes[m] = ("stop", sorted(outcome.reports))

    def run(self, seconds=20.0):
        now = 0.0
        while now < seconds and any(m not in self.outcomes for m in self.running):
            now += TICK
            self.tick(now)
        return self.outcomes, now


def test_a_majority_goes_on_from_the_furthest_step():
    net = FakeNetwork([0, 1, 2], {0: [1, 12], 1: [1, 13], 2: [1, 12]}, killed=[2], lost={0: 2, 1: 2})
    outcomes, seconds = net.run()
    assert outcomes == {0: ("go on", ([0, 1], 1, [1, 13])), 1: ("go on", ([0, 1], 1, [1, 13]))}
    assert seconds < 0.5  # a refused port is final: nobody waits for the settle time


def test_two_lost_at_once_and_the_rest_still_a_majority():
    positions = {m: [2, 7] for m in range(5)}
    outcomes, _ = FakeNetwork(list(range(5)), positions, killed=[3, 4], lost={0: 3, 1: 4, 2: 3}).run()
    assert {m: o[1][0] for m, o in outcomes.items()} == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}


def test_exactly_half_goes_on_only_with_the_lowest_rank():
    """A cut between {0, 1} and {2, 3}: the half with rank 0 goes on, the other stops."""
    lost = {0: 2, 1: 3, 2: 0, 3: 1}
    net = FakeNetwork([0, 1, 2, 3], {m: [1, 5] for m in range(4)}, sides=[[0, 1], [2, 3]], lost=lost)
    outcomes, seconds = net.run()
    assert outcomes == {
        0: ("go on", ([0, 1], 0, [1, 5])),
        1: ("go on", ([0, 1], 0, [1, 5])),
        2: ("stop", [2, 3]),
        3: ("stop", [3]),  # rank 3 waits for its side's leader, rank 2, which stops: then it stops too
    }
    assert seconds > net.heartbeat  # the other side is taken for gone only after a heartbeat of silence


def test_a_minority_without_rank_0_stops_and_the_majority_goes_on_under_rank_1():
    outcomes, _ = FakeNetwork(
        [0, 1, 2], {m: [1, 3] for m in range(3)}, sides=[[0], [1, 2]], lost={0: 1, 1: 0, 2: 0}
    ).run()
    assert outcomes[0] == ("stop", [0])
    assert outcomes[1] == outcomes[2] == ("go on", ([1, 2], 1, [1, 3]))


def test_a_frozen_leader_is_left_behind_then_fenced_when_it_speaks():
    net = FakeNetwork([0, 1, 2], {m: [1, 9] for m in range(3)}, frozen=[0], lost={1: 0, 2: 0})
    outcomes, seconds = net.run()
    assert outcomes == {1: ("go on", ([1, 2], 1, [1, 9])), 2: ("go on", ([1, 2], 1, [1, 9]))}
    assert seconds < agreement.SETTLE_SECONDS  # they saw it silent for a heartbeat already: no more waiting
    # rank 0 wakes and says "alive, generation 0" to the members of generation 1: they fence it
    assert agreement.must_fence(0, 1, 0, [1, 2]) and not agreement.must_fence(1, 1, 1, [1, 2])
    assert agreement.move(State.TRAINING, State.FENCED) is State.FENCED
    with pytest.raises(AssertionError):
        agreement.move(State.FENCED, State.TRAINING)


def test_a_slow_member_that_did_not_see_the_loss_is_waited_for():
    """Rank 1 sees rank 2 die; rank 0 has not noticed yet and answers only after a second."""
    net = FakeNetwork([0, 1, 2], {0: [1, 4], 1: [1, 4], 2: [1, 4]}, killed=[2], lost={1: 2})
    net.running.remove(0)
    outcomes = {}
    for i in range(1, 60):
        if i == 20:  # rank 0 joins the agreement
            net.running.insert(0, 0)
        net.tick(i * TICK)
    outcomes = net.outcomes
    assert outcomes[0] == outcomes[1] == ("go on", ([0, 1], 0, [1, 4]))


def test_a_growth_names_its_joiners_and_a_joiner_that_dies_is_agreed_away():
    book = {"0": "e0", "1": "e1", "2": "e2"}
    members, new_book, joined = agreement.growth([0, 1], book, [("aa" * 6, 2, "j2"), ("bb" * 6, None, "j3")])
    assert members == [0, 1, 2, 3] and joined == {"aa" * 6: 2, "bb" * 6: 3} and new_book["2"] == "j2"
    # the joiners' group did not form (one died): generation 0's members agree again, as they were
    outcomes, _ = FakeNetwork([0, 1], {0: [1, 8], 1: [1, 8]}).run()
    assert outcomes == {0: ("go on", ([0, 1], 0, [1, 8])), 1: ("go on", ([0, 1], 0, [1, 8]))}


def test_a_growth_and_a_loss_at_once():
    """A server waits to join when rank 2 dies: the growth fails, the survivors agree without
    rank 2 (the joiner asks again and is taken in by the next generation)."""
    outcomes, _ = FakeNetwork([0, 1, 2], {m: [1, 6] for m in range(3)}, killed=[2], lost={0: 2}).run()
    assert outcomes[0] == outcomes[1] == ("go on", ([0, 1], 0, [1, 6]))
    members, _, joined = agreement.growth([0, 1], {"0": "e0", "1": "e1", "2": "e2"}, [("cc" * 6, 2, "j")])
    assert members == [0, 1, 2] and joined == {"cc" * 6: 2}  # its old rank is free again


def test_quorum_rule():
    assert agreement.has_quorum([0, 1], [0, 1, 2]) and not agreement.has_quorum([2], [0, 1, 2])
    assert agreement.has_quorum([0, 3], [0, 1, 2, 3]) and not agreement.has_quorum([1, 3], [0, 1, 2, 3])
