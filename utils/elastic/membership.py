"""Who is in the job: a failure detector beside gloo, and the survivors' agreement when a rank is lost.

    membership = Membership(me, heartbeat, address, key, instruments=OFF)  every rank (utils/elastic/join.py)
    membership.start(book, token)                  the ranks' control addresses, exchanged once
    membership.carry(record)                       this rank's progress, which its heartbeats carry
    decision = membership.agree(report)            after a lost peer: who goes on, from where
    decision = membership.grow(report, timeout)    a server waits to join: the next generation
    membership.join(decision, timeout, ...)        the decided generation's default process group

A Membership is made of parts, each owning its own state, that share one Roster (who is in, the
state below and the lock: utils/elastic/roster.py):
    Detector   heartbeats and inbox on a UDP socket, fencing (utils/elastic/detector.py); every
               datagram is signed with the job's key and checked (utils/elastic/wire.py) before use
    Ballot     this rank's side of an agreement (utils/elastic/agreement.py, whose rules are pure logic)
    Growth     the joins (utils/elastic/growth.py)
The group of the next generation is formed by utils/elastic/former.py.

    State:  TRAINING --a loss--> RECOVERING --a group formed--> TRAINING
            TRAINING --a server waits--> GROWING --formed--> TRAINING (a loss meanwhile: RECOVERING)
            any --told the job went on without it--> FENCED (it stops and writes nothing)

A member of an older generation that speaks up (a frozen server woken by SIGCONT) is told it
was fenced out; it stops (Fenced) without writing anything: the survivors own the checkpoint.
"""

import os
import time

import torch.distributed as dist

from utils.elastic import agreement
from utils.elastic.agreement import Ballot, Fenced, NoQuorum, State
from utils.elastic.detector import Detector, ThreadClocks
from utils.elastic.former import form_group
from utils.elastic.growth import Growth
from utils.elastic.rejoin import keep_book
from utils.elastic.roster import Roster
from utils.elastic.wire import Decision, Join, Refused
from utils.errors import UsageError
from utils.observe.instruments import OFF

MAX_AGREE_SECONDS = 60.0  # an agreement that takes longer is given up (NoQuorum)


class Membership:
    """This rank's view of the job (see the module's docstring): its parts, each with its own state,
    share the roster. me: the rank's id for the whole job (its rank in the first generation; None:
    a server that joins, until it is taken in); key: the job's key (bytes); port: where it listens
    (the job's port + its rank; any free port if taken); instruments: where the agreement's events
    and a break are logged (utils/observe/instruments.py); request_stop(reason): what train.py --stop asks
    of this process (utils.setup.stop.request, handed in by train.py; None: it is refused)."""

    def __init__(self, me, heartbeat, address, key, port=0, instruments=OFF, request_stop=None):
        self.roster, self.ballot, self.cpu = Roster(me), Ballot(), ThreadClocks()
        self.instruments = instruments
        self.detector = Detector(
            self.roster, self.ballot, heartbeat, address, key, port, instruments, self.cpu, request_stop
        )
        self.growth = Growth(self.roster, self.detector)
        self.detector.route(Join, self.growth.on_join)
        self.detector.route(Refused, self.growth.on_refused)
        self.leading = None  # (decision, its group's store) while this rank leads a generation that has not formed
        self.book_file = None  # the checkpoint beside which the members' addresses are kept (utils/elastic/rejoin.py)

    # -- what others read ---------------------------------------------------------------------
    me = property(lambda self: self.roster.me)
    members = property(lambda self: self.roster.members)
    book = property(lambda self: self.roster.book)
    heartbeat = property(lambda self: self.detector.heartbeat)
    address = property(lambda self: self.detector.address)
    envelope = property(lambda self: self.detector.envelope)
    broken = property(lambda self: self.detector.broken)
    reason = property(lambda self: self.detector.reason)
    lost = property(lambda self: self.detector.lost)
    settings = property(lambda self: self.growth.settings)
    identity = property(lambda self: self.growth.identity)

    def start(self, book, token):
        """Begin: `book` maps every id to its address (this rank's `address` among them)."""
        self.roster.book, self.roster.token = book, token
        self.roster.members = sorted(book)
        self.detector.start(token)

    def start_beating(self):
        """A joined server: heartbeats from now on (its receiver runs since request_join)."""
        self.detector.start_beating()

    def carry(self, record):
        """This rank's progress (a utils.elastic.status.Record): its beats carry it (train.py --status)."""
        self.detector.carry(record)

    def require(self, settings, identity):
        """What a joining server must have alike: these settings ({name: value}) and program identity."""
        self.growth.require(settings, identity)

    def dropped(self):
        """One line on the datagrams this rank dropped, or None if it dropped none."""
        return self.detector.dropped()

    def rank_of(self, member):
        return self.roster.rank_of(member)

    # -- growth ----------------------------------------------------------------------------------
    def request_join(self, candidates, settings, identity, want, timeout):
        """A new server asks the job to take it in (utils/elastic/growth.Growth.request_join)."""
        return self.growth.request_join(candidates, settings, identity, want, timeout)

    def wants_growth(self):
        """The leader has a server waiting to join (it rides in the stop flag: utils/run.py)."""
        return self.growth.wants_growth()

    def forget_joiners(self, decision):
        """A growth that failed: its joiners (all, if it decided nothing) must ask again."""
        self.growth.forget_joiners(decision)

    def grow(self, report, timeout):
        """Every member, at the step boundary whose sum said a server waits: the next generation's
        decision (the leader decides; the others wait for it). A RuntimeError if none comes."""
        decision, store = self.growth.grow(report, timeout)
        if store is not None:
            self.leading = (decision, store)
        return decision

    # -- a lost member: the survivors agree --------------------------------------------------------
    def view(self, generation, attempt, started):
        """What this rank knows now (utils/elastic/agreement.View), under the lock."""
        now, roster, ballot, detector = time.monotonic(), self.roster, self.ballot, self.detector
        return agreement.View(
            roster.me,
            roster.members,
            {**ballot.reports_for(generation, attempt), roster.me: ballot.report},
            detector.silences(now),
            frozenset(detector.refused),
            detector.lost,
            ballot.named_in(generation),
            now - started,
            detector.heartbeat,
        )

    def agree(self, report, tried=()):
        """Block until this generation's survivors agree; returns the decision (a wire.Decision).
        Raises NoQuorum or Fenced. report: this rank's position, [epoch, step] (the step it last completed)."""
        roster, detector = self.roster, self.detector
        detector.break_("this rank lost a peer")
        started = time.monotonic()
        with roster.lock:
            if roster.state == State.FENCED:
                raise Fenced(detector.fenced_at)
            roster.move(State.RECOVERING)
            attempt = len(tried)  # the survivors' try at forming this generation's successor
            self.ballot.begin(report, attempt)
            self.leading = None
            detector.stop_announcing()
        generation = roster.generation
        while True:
            with roster.lock:
                if detector.fenced_at is not None:
                    raise Fenced(detector.fenced_at)
                later = [d for _, d in detector.decisions if d.g > generation]
                mine = [d for d in later if roster.me in d.members and d.attempt == attempt and d.name not in tried]
                outsider = [d for d in later if roster.me not in d.members]
                view = self.view(generation, attempt, started)
            if mine:
                return mine[0]
            if outsider:
                raise Fenced(outsider[0].g)
            outcome = agreement.assess(view)
            if outcome.action == "decide":
                self.instruments.log(
                    event="agreed", g=generation + 1, attempt=attempt, reports=outcome.reports, gone=outcome.gone
                )
                return self._decide(generation, outcome.reports, attempt)
            if outcome.action == "give up":
                self.instruments.log(
                    event="no-quorum", g=generation, attempt=attempt, reports=outcome.reports, gone=outcome.gone
                )
                raise NoQuorum(set(outcome.reports), view.members, outcome.gone)
            if view.elapsed > MAX_AGREE_SECONDS:
                raise NoQuorum(set(outcome.reports), view.members, outcome.gone)
            time.sleep(0.01)

    def _decide(self, generation, reports, attempt):
        """The leader: the next generation's members, store and source (the furthest position)."""
        roster = self.roster
        store = dist.TCPStore(roster.book[roster.me]["address"][0], 0, is_master=True, wait_for_workers=False)
        members, source, furthest = agreement.successor(roster.members, reports)
        decision = Decision(
            generation + 1,
            f"{generation + 1}.{roster.me}.{os.urandom(4).hex()}",
            members,
            [roster.book[roster.me]["address"][0], store.port],
            source,
            furthest,
            {str(m): list(reports[m]) for m in members},
            attempt,
        )
        self.leading = (decision, store)
        self.detector.announce(decision)
        return decision

    # -- the next generation forms -----------------------------------------------------------------
    def join(self, decision, timeout, gloo_timeout):
        """Form the decided generation's default process group; returns this rank's new rank.
        A RuntimeError if a member does not come within `timeout` (then agree() again)."""
        roster = self.roster
        roster.forming = decision.members
        try:
            leading = self.leading
            mine = leading is not None and leading[0] is decision and decision.members[0] == roster.me
            form_group(decision, roster.me, leading[1] if mine else None, timeout, gloo_timeout)
        finally:
            roster.forming = ()
        with roster.lock:
            changed = roster.adopt(decision)
            self.detector.begin_generation(decision.members, changed)
            self.growth.taken_in(decision)
            self.ballot.clear()
            self.leading = None
        if self.book_file is not None:
            try:
                keep_book(roster.book, self.book_file)
            except UsageError:  # (a full disk: the book is a convenience; the checkpoint says the rest)
                pass
        return decision.members.index(roster.me)
