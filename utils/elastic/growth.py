"""Taking a new server in (--join): the membership's part for a running job's growth.

    growth = Growth(roster, detector)                    the detector routes Join and Refused to it
    growth.request_join(candidates, settings, ...)       the new server asks any member
    growth.on_join(...)                                  a member passes the request to the leader
    growth.wants_growth()                                the leader raises the join flag with a step's sum
    growth.grow(report, timeout)                         at that step, the leader decides the next generation

It owns the join requests heard (the leader's), this server's own request and its refusal, and
what a joining server must have alike with the job (require()); who is in is the roster's
(utils/elastic/roster.py), the sending and the decisions received are the detector's.
"""

import os
import socket
import time

import torch.distributed as dist

from utils.elastic import agreement
from utils.elastic.agreement import State
from utils.elastic.wire import Decision, Join, Refused
from utils.setup.program import differences
from utils.store.outputs import job_pid
from utils.sync.flags import MAX_RANKS

FRESH_SECONDS = 2.0  # a join request not heard again within this: the server is gone or in


class Growth:
    """The joins of one rank: as the job's leader, the servers that wait to join; as a new server,
    its own request."""

    def __init__(self, roster, detector):
        self.roster, self.detector = roster, detector
        self.settings, self.identity = None, None  # what a joining server must have alike (require())
        self.joining = {}  # the leader: nonce -> (join request, when last heard) of a server waiting to join
        self.nonce, self.refusal = None, None  # a joining server: its request's nonce; why it was refused

    def require(self, settings, identity):
        """A joining server must have these settings ({name: value}) and this program identity."""
        self.settings, self.identity = settings, identity

    def on_join(self, sender, job, message):
        """A join request (utils/elastic/join.py: --join): the leader takes it, any other member passes it on."""
        roster = self.roster
        with roster.lock:
            leader = roster.members[0] if roster.members else None
            if leader is None or roster.state != State.TRAINING:
                return
        if leader != roster.me:
            self.detector.send(leader, message)
            return
        reason = self.refusal_of(message)
        if reason is not None:
            self.detector.send_to(
                tuple(message.entry["address"]), Refused(message.nonce, reason), to=f"join-{message.nonce}"
            )
            return
        with roster.lock:  # it asks again every 0.2 s
            self.joining[message.nonce] = (message, time.monotonic())

    def refusal_of(self, message):
        """Why the job cannot take in the server that sent join request `message`, or None."""
        reason = differences(message.identity, self.identity, "this server", "the job")
        for name, value in (self.settings or {}).items():
            if reason is None and message.settings.get(name) != value:
                reason = f"the job has --{name} {value}, this server has {message.settings.get(name)}"
        with self.roster.lock:
            members = len(self.roster.members)
            if reason is None and members + len(self.joining.keys() - {message.nonce}) >= MAX_RANKS:
                reason = f"the job has {members} members, the most a job can have is {MAX_RANKS}"
        return reason

    def on_refused(self, sender, job, message):
        if self.nonce is not None and message.nonce == self.nonce:
            self.refusal = message.reason

    def taken_in(self, decision):
        """(Under the lock) a generation formed: the servers it took in wait no more."""
        for nonce in decision.joined:
            self.joining.pop(nonce, None)

    def forget_joiners(self, decision):
        """A growth that failed: its joiners (all, if it decided nothing) must ask again; one that
        died meanwhile would otherwise fail every growth after it."""
        with self.roster.lock:
            for nonce in decision.joined if decision else list(self.joining):
                self.joining.pop(nonce, None)

    def wants_growth(self):
        """The leader has a server waiting to join (it rides in the stop flag: utils/run.py)."""
        return bool(self.fresh_joiners()) and self.roster.members[0] == self.roster.me

    def fresh_joiners(self):
        """The join requests heard in the last 2 s: a server that stopped asking is gone or in."""
        with self.roster.lock:
            return [request for request, heard in self.joining.values() if time.monotonic() - heard < FRESH_SECONDS]

    def grow(self, report, timeout):
        """Every member, at the step boundary whose sum said a server waits: (the next generation,
        the members and the waiting servers; the store of its group if this rank decided it, else
        None). The leader decides; the others wait for it."""
        roster = self.roster
        generation = roster.generation
        with roster.lock:
            roster.move(State.GROWING)
        if roster.members[0] == roster.me:
            return self._decide_growth(report)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.detector.broken.is_set():  # (a member lost meanwhile: agree)
            with roster.lock:  # a growth's decision, not a recovery's
                found = [
                    d
                    for _, d in self.detector.decisions
                    if d.g > generation and roster.me in d.members and d.attempt is None
                ]
            if found:
                return found[-1], None
            time.sleep(0.01)
        with roster.lock:
            if roster.state == State.GROWING:
                roster.move(State.TRAINING)
        raise RuntimeError(f"rank {roster.members[0]} decided nothing within {timeout:g} s")

    def _decide_growth(self, report):
        roster = self.roster
        waiting = [(r.nonce, r.want, r.entry) for r in self.fresh_joiners()]
        book = {str(m): entry for m, entry in roster.book.items()}
        members, book, joined = agreement.growth(roster.members, book, waiting)
        store = dist.TCPStore(roster.book[roster.me]["address"][0], 0, is_master=True, wait_for_workers=False)
        decision = Decision(
            roster.generation + 1,
            f"{roster.generation + 1}.{roster.me}.{os.urandom(4).hex()}",
            members,
            [roster.book[roster.me]["address"][0], store.port],
            roster.me,
            list(report),
            book=book,
            joined=joined,
        )
        self.detector.announce(decision)
        return decision, store

    def request_join(self, candidates, settings, identity, want, timeout):
        """A new server: ask the job at `candidates` ((host, port), any member) to take it in at its
        next step; returns the decision, or raises ValueError (refused: its reason) or RuntimeError
        (no answer: the job is not there, or its key is not this server's)."""
        detector = self.detector
        with self.roster.lock:  # (asked again after a growth that did not form: a new request)
            self.nonce, self.refusal = os.urandom(6).hex(), None
            detector.await_decision(self.nonce)
            detector.sign_as(f"join-{self.nonce}")
        entry = {"address": list(detector.address), "pid": job_pid(), "host": socket.gethostname()}
        request = Join(self.nonce, want, settings, entry, identity)
        detector.listen()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for candidate in candidates:
                try:
                    detector.send_to(candidate, request)
                except OSError:
                    pass
            for _ in range(20):
                if self.refusal is not None:
                    raise ValueError(self.refusal)
                with self.roster.lock:
                    found = [(job, d) for job, d in detector.decisions if self.nonce in d.joined]
                if found:
                    return self._taken_in_as(*found[0])
                time.sleep(0.01)
        raise RuntimeError(f"no member of a job answered within {timeout:g} s")

    def _taken_in_as(self, job, decision):
        """A joining server that a decision takes in: the roster becomes the job's, as before the
        generation it forms (the group forms in Membership.join; then it trains)."""
        roster = self.roster
        with roster.lock:
            roster.move(State.GROWING)
        roster.me, roster.token = decision.joined[self.nonce], job
        self.detector.sign_as(roster.me, job)
        roster.book = {int(m): entry for m, entry in decision.book.items()}
        roster.members, roster.generation = decision.members, decision.g - 1
        return decision
