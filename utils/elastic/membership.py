"""Who is in the job: a failure detector beside gloo, and the survivors' agreement when a rank is lost.

    membership = Membership(me, heartbeat, address, key)  every rank (utils/elastic/join.py)
    membership.start(book, token)                         the ranks' control addresses, exchanged once
    decision = membership.agree(report)                   after a lost peer: who goes on, from where
    membership.join(decision, timeout)                    the survivors' new default process group

The failure detector (utils/elastic/detector.py) notices a lost member and ends the
generation; every datagram is signed with the job's key and checked (utils/elastic/wire.py)
before it is used. The agreement's rules are pure logic (utils/elastic/agreement.py); the group
of the next generation is formed by utils/elastic/former.py; the join half is growth.py.

    State:  TRAINING --a loss--> RECOVERING --a group formed--> TRAINING
            TRAINING --a server waits--> GROWING --formed--> TRAINING (a loss meanwhile: RECOVERING)
            any --told the job went on without it--> FENCED (it stops and writes nothing)

A member of an older generation that speaks up (a frozen server woken by SIGCONT) is told it
was fenced out; it stops (Fenced) without writing anything: the survivors own the checkpoint.
"""

import os
import time

import torch.distributed as dist

from utils.elastic import agreement, faults
from utils.elastic.agreement import Fenced, NoQuorum, State
from utils.elastic.detector import Detector
from utils.elastic.former import form_group
from utils.elastic.growth import Growth
from utils.elastic.rejoin import keep_book
from utils.elastic.wire import Decision
from utils.errors import UsageError

MAX_AGREE_SECONDS = 60.0  # an agreement that takes longer is given up (NoQuorum)


class Membership(Detector, Growth):
    """This rank's view of the job (see the module's docstring)."""

    def view(self, generation, attempt, started):
        """What this rank knows now (utils/elastic/agreement.View), under the lock."""
        now = time.monotonic()
        reports = {m: r for m, (g, a, r) in self.reports.items() if g == generation and a == attempt}
        return agreement.View(
            self.me,
            self.members,
            {**reports, self.me: self.report},
            {m: now - t for m, t in self.heard.items()},
            frozenset(self.refused),
            self.lost,
            frozenset(m for m, g in self.named.items() if g == generation),
            now - started,
            self.heartbeat,
        )

    def agree(self, report, tried=()):
        """Block until this generation's survivors agree; returns the decision (a wire.Decision).
        Raises NoQuorum or Fenced. report: this rank's position, [epoch, step] (the step it last completed)."""
        self.break_("this rank lost a peer")
        started = time.monotonic()
        with self.lock:
            if self.state == State.FENCED:
                raise Fenced(self.fenced_at)
            self.move(State.RECOVERING)
            self.report, self.sending = report, None
            self.attempt = attempt = len(tried)  # the survivors' try at forming this generation's successor
        generation = self.generation
        while True:
            with self.lock:
                if self.fenced_at is not None:
                    raise Fenced(self.fenced_at)
                later = [d for _, d in self.decisions if d.g > generation]
                mine = [d for d in later if self.me in d.members and d.attempt == attempt and d.name not in tried]
                outsider = [d for d in later if self.me not in d.members]
                view = self.view(generation, attempt, started)
            if mine:
                return mine[0]
            if outsider:
                raise Fenced(outsider[0].g)
            outcome = agreement.assess(view)
            if outcome.action == "decide":
                faults.log(
                    event="agreed", g=generation + 1, attempt=attempt, reports=outcome.reports, gone=outcome.gone
                )
                return self._decide(generation, outcome.reports, attempt)
            if outcome.action == "give up":
                faults.log(event="no-quorum", g=generation, attempt=attempt, reports=outcome.reports, gone=outcome.gone)
                raise NoQuorum(set(outcome.reports), view.members, outcome.gone)
            if view.elapsed > MAX_AGREE_SECONDS:
                raise NoQuorum(set(outcome.reports), view.members, outcome.gone)
            time.sleep(0.01)

    def _decide(self, generation, reports, attempt):
        """The leader: the next generation's members, store and source (the furthest position)."""
        store = dist.TCPStore(self.book[self.me]["address"][0], 0, is_master=True, wait_for_workers=False)
        members, source, furthest = agreement.successor(self.members, reports)
        decision = Decision(
            generation + 1,
            f"{generation + 1}.{self.me}.{os.urandom(4).hex()}",
            members,
            [self.book[self.me]["address"][0], store.port],
            source,
            furthest,
            {str(m): list(reports[m]) for m in members},
            attempt,
        )
        with self.lock:
            self.sending, self.leader_store = decision, store
        self._send_decision(decision)  # now, not only with the next beat: a leader that stops (--no-recover) leaves
        return decision

    def _send_decision(self, decision):
        for member in decision.joined.values():  # into the book now: a joiner that died refuses
            entry = decision.book[str(member)]
            if self.book.get(member) != entry:
                self.book[member] = entry
                if member in self.peers:
                    self.peers.pop(member).close()
        for member in decision.members:
            if member != self.me:
                self._send(member, decision)

    def join(self, decision, timeout, gloo_timeout):
        """Form the decided generation's default process group; returns this rank's new rank.
        A RuntimeError if a member does not come within `timeout` (then agree() again)."""
        self.forming = decision.members
        try:
            store = self.leader_store if decision.members[0] == self.me and self.sending is decision else None
            form_group(decision, self.me, store, timeout, gloo_timeout)
        finally:
            self.forming = ()
        with self.lock:
            self.generation, self.members = decision.g, decision.members
            for m, entry in decision.book.items():
                if self.book.get(int(m)) != entry and int(m) in self.peers:  # a new server under an old rank
                    self.peers.pop(int(m)).close()
                self.book[int(m)] = entry
            self.refused -= set(decision.members)
            for nonce in decision.joined:
                self.joining.pop(nonce, None)
            if self.state != State.FENCED:
                self.move(State.TRAINING)
            self.report, self.sending = None, None
            self.reports, self.decisions, self.lost, self.named = {}, [], None, {}
            now = time.monotonic()
            self.heard = {m: now for m in decision.members}
            self.broken.clear()
        if self.book_file is not None:
            try:
                keep_book(self.book, self.book_file)
            except UsageError:  # (a full disk: the book is a convenience; the checkpoint says the rest)
                pass
        return decision.members.index(self.me)
