"""The survivors' agreement as pure logic: from what a rank has heard to what it does next.

No sockets, no clocks, no torch: utils/elastic/membership.py gathers a View every 10 ms while
it recovers (from its Ballot, this rank's side of the agreement, and what its detector heard) and
acts on assess()'s answer; tests/unit/test_agreement.py runs whole jobs of these over a fake network.

    every rank:  "recovering g, my position (epoch, step)"   to every member, every 50 ms
    a member is gone when its port refuses (a killed process), or it stays silent
    the leader (the lowest rank that is not gone), once every member has answered or is gone:
        quorum?  more than half of generation g, or exactly half with g's lowest rank
        no:      NoQuorum: nobody goes on on this side (no split brain)
        yes:     the next generation: the members that answered, from the furthest position
"""

import dataclasses
import enum

SETTLE_SECONDS = 1.0  # every live member answers within this; a silent one is gone after it
BROKE_IT = "it broke this generation"
OTHERS_LOST_IT = "another rank lost it"


class State(enum.Enum):
    TRAINING = "training"
    RECOVERING = "recovering"
    GROWING = "growing"
    FENCED = "fenced"


TRANSITIONS = {  # the only moves there are
    State.TRAINING: {State.RECOVERING, State.GROWING, State.FENCED},
    State.GROWING: {State.TRAINING, State.RECOVERING, State.GROWING, State.FENCED},  # (a joiner asks again)
    State.RECOVERING: {State.RECOVERING, State.TRAINING, State.FENCED},
    State.FENCED: {State.FENCED},
}


def move(state, to):
    """The state after moving from `state` to `to`; a move that TRANSITIONS lacks is a bug."""
    if to not in TRANSITIONS[state]:
        raise AssertionError(f"the membership cannot go from {state.value} to {to.value}")
    return to


class NoQuorum(Exception):
    """The ranks still reachable are too few to go on (or this side of a split lost)."""

    def __init__(self, alive, members, gone=None):
        why = "; ".join(f"rank {m}: {reason}" for m, reason in sorted((gone or {}).items()))
        super().__init__(
            f"only rank{'s' if len(alive) > 1 else ''} {', '.join(map(str, sorted(alive)))} of "
            f"{len(members)} {'are' if len(alive) > 1 else 'is'} reachable{f' ({why})' if why else ''}: "
            f"not a majority, so this side stops (the other side, if it has the majority, goes on)"
        )
        self.alive, self.members = alive, members


class Fenced(Exception):
    """The job went on without this rank (it was frozen or cut off meanwhile)."""

    def __init__(self, generation):
        super().__init__(
            f"the job went on without this rank (generation {generation}); it wrote nothing (the "
            f"survivors hold the job's checkpoint)"
        )


class Ballot:
    """This rank's side of an agreement in progress: its own position and try, and what the other
    members' beats reported and named (utils/elastic/detector.py hears them). Read and changed under
    the roster's lock (utils/elastic/roster.py)."""

    def __init__(self):
        self.report = None  # while recovering: this rank's position, [epoch, step]
        self.attempt = 0  # while recovering: how many decisions did not form
        self.reports = {}  # member -> (generation, attempt, report) its last recovering beat carried
        self.named = {}  # member -> the generation in which a survivor saw it fall silent

    def begin(self, report, attempt):
        self.report, self.attempt = report, attempt

    def heard(self, sender, g, attempt, report, lost):
        """A member's recovering beat: its report, and the member it saw fall silent (or None)."""
        self.reports[sender] = (g, attempt, report)
        if lost is not None:
            self.named[lost] = g

    def clear(self):
        """A generation formed: nothing of the last agreement counts."""
        self.report, self.reports, self.named = None, {}, {}

    def reports_for(self, generation, attempt):
        """{member: report} that the others' beats carried for this generation and attempt."""
        return {m: r for m, (g, a, r) in self.reports.items() if g == generation and a == attempt}

    def named_in(self, generation):
        return frozenset(m for m, g in self.named.items() if g == generation)


def has_quorum(alive, members):
    """More than half of `members` (in rank order), or exactly half holding their rank 0."""
    alive = set(alive) & set(members)
    return 2 * len(alive) > len(members) or (2 * len(alive) == len(members) and members[0] in alive)


@dataclasses.dataclass(frozen=True)
class View:
    """What one rank knows, `elapsed` seconds into its agreement on generation g's successor."""

    me: int
    members: list  # generation g's, in rank order
    reports: dict  # member -> [epoch, step], heard for this generation and attempt (this rank's own among them)
    silent_for: dict  # member -> seconds since it was last heard (absent: never)
    refused: frozenset = frozenset()  # members whose port refused a datagram (their process is gone)
    lost: int | None = None  # the member whose loss this rank saw first
    named: frozenset = frozenset()  # members another rank saw fall silent in this generation
    elapsed: float = 0.0
    heartbeat: float = 5.0


@dataclasses.dataclass(frozen=True)
class Outcome:
    """assess()'s answer: "wait", "decide" (this rank leads the next generation) or "give up"."""

    action: str
    reports: dict  # of the members that are not gone
    gone: dict  # member -> why it is taken for gone


def gone_members(view):
    """{member: why} for every member (not this rank) taken for gone; a reporter may die too."""
    settled, gone = view.elapsed > SETTLE_SECONDS, {}
    for m in view.members:
        silent = view.silent_for.get(m, float("inf"))
        if m == view.me:
            continue
        if m in view.refused:
            gone[m] = "its port refused"
        elif settled and silent > view.heartbeat:
            gone[m] = f"silent {silent:.1f} s" if silent != float("inf") else "never heard"
        elif m == view.lost and m not in view.reports:
            gone[m] = BROKE_IT
        elif m in view.named and m not in view.reports and silent > min(0.5, view.heartbeat):
            gone[m] = OTHERS_LOST_IT
    return gone


def assess(view):
    """What this rank does now: wait for more answers, decide the next generation, or give up."""
    gone = gone_members(view)
    reports = {m: r for m, r in view.reports.items() if m not in gone and m in view.members}
    pending = [m for m in view.members if m not in reports and m not in gone]
    if pending or next(m for m in view.members if m not in gone) != view.me:
        return Outcome("wait", reports, gone)
    if has_quorum(reports, view.members):
        return Outcome("decide", reports, gone)
    # too few: give up only once every missing member has been silent for a heartbeat (one that
    # was slow to notice the loss may still report; a refused port is final)
    if all(why not in (BROKE_IT, OTHERS_LOST_IT) for why in gone.values()):
        return Outcome("give up", reports, gone)
    return Outcome("wait", reports, gone)


def must_fence(their_generation, generation, sender, members):
    """Whether a member that speaks up from an older generation, and is not in this one, is told
    the job went on without it (a frozen server woken, a cut-off one reconnected)."""
    return their_generation < generation and sender not in members


def successor(members, reports):
    """The next generation's (members, source, position): those that answered, in rank order (rank
    0 stays first if alive), from the furthest position any of them completed."""
    members = [m for m in members if m in reports]
    furthest = max(tuple(r) for r in reports.values())
    return members, next(m for m in members if tuple(reports[m]) == furthest), list(furthest)


def growth(members, book, waiting):
    """A growth's (members, book, joined): each waiting server (nonce, want, entry) gets its old
    rank if it is free, else the next id after every id the job has used."""
    book, joined, members = dict(book), {}, list(members)
    for nonce, want, entry in waiting:
        taken = {int(m) for m in book} | set(joined.values())
        member = want if want is not None and want not in members else max(taken) + 1
        joined[nonce] = member
        book[str(member)] = entry
        members.append(member)
    return members, book, joined
