"""Taking a new server in (--join): Membership's side of a running job's growth.

    request_join(candidates, settings, want, timeout)    the new server asks any member
    _on_join(message)                                    a member passes the request to the leader
    wants_growth()                                       the leader raises the join flag with a step's sum
    grow(report, timeout)                                at that step, the leader decides the next generation

Membership (utils/elastic/membership.py) is a Growth: the state these methods use (the lock,
the book of members, the socket) is the membership's own.
"""

import os
import socket
import threading
import time

import torch.distributed as dist

from utils.elastic import agreement
from utils.elastic.agreement import State
from utils.elastic.wire import Decision, Join, Refused
from utils.setup.program import differences
from utils.store.outputs import job_pid
from utils.sync.flags import MAX_RANKS


class Growth:
    """The join half of Membership (see membership.py for the fields it shares)."""

    def _on_join(self, sender, job, message):
        """A join request (utils/elastic/join.py: --join): the leader takes it, any other member passes it on."""
        with self.lock:
            leader = self.members[0] if self.members else None
            if leader is None or self.state != State.TRAINING:
                return
        if leader != self.me:
            self._send(leader, message)
            return
        reason = differences(message.identity, self.identity, "this server", "the job")
        for name, value in (self.settings or {}).items():
            if reason is None and message.settings.get(name) != value:
                reason = f"the job has --{name} {value}, this server has {message.settings.get(name)}"
        with self.lock:
            if reason is None and len(self.members) + len(self.joining.keys() - {message.nonce}) >= MAX_RANKS:
                reason = f"the job has {len(self.members)} members, the most a job can have is {MAX_RANKS}"
        if reason is not None:
            self.sock.sendto(
                self.envelope.seal(Refused(message.nonce, reason), to=f"join-{message.nonce}"),
                tuple(message.entry["address"]),
            )
            return
        with self.lock:  # it asks again every 0.2 s
            self.joining[message.nonce] = (message, time.monotonic())

    def forget_joiners(self, decision):
        """A growth that failed: its joiners (all, if it decided nothing) must ask again; one that
        died meanwhile would otherwise fail every growth after it."""
        with self.lock:
            for nonce in decision.joined if decision else list(self.joining):
                self.joining.pop(nonce, None)

    def wants_growth(self):
        """The leader has a server waiting to join (it rides in the stop flag: utils/run.py)."""
        return bool(self.fresh_joiners()) and self.members[0] == self.me

    def fresh_joiners(self):
        """The join requests heard in the last 2 s: a server that stopped asking is gone or in."""
        with self.lock:
            return [request for request, heard in self.joining.values() if time.monotonic() - heard < 2.0]

    def grow(self, report, timeout):
        """Every member, at the step boundary whose sum said a server waits: the next generation,
        the members and the waiting servers (the leader decides; the others wait for it)."""
        generation = self.generation
        with self.lock:
            self.move(State.GROWING)
        if self.members[0] == self.me:
            return self._decide_growth(report)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.broken.is_set():  # (a member lost meanwhile: agree)
            with self.lock:  # a growth's decision, not a recovery's
                found = [
                    d for _, d in self.decisions if d.g > generation and self.me in d.members and d.attempt is None
                ]
            if found:
                return found[-1]
            time.sleep(0.01)
        with self.lock:
            if self.state == State.GROWING:
                self.move(State.TRAINING)
        raise RuntimeError(f"rank {self.members[0]} decided nothing within {timeout:g} s")

    def _decide_growth(self, report):
        waiting = [(r.nonce, r.want, r.entry) for r in self.fresh_joiners()]
        book = {str(m): entry for m, entry in self.book.items()}
        members, book, joined = agreement.growth(self.members, book, waiting)
        store = dist.TCPStore(self.book[self.me]["address"][0], 0, is_master=True, wait_for_workers=False)
        decision = Decision(
            self.generation + 1,
            f"{self.generation + 1}.{self.me}.{os.urandom(4).hex()}",
            members,
            [self.book[self.me]["address"][0], store.port],
            self.me,
            list(report),
            book=book,
            joined=joined,
        )
        with self.lock:
            self.sending, self.leader_store = decision, store
        self._send_decision(decision)
        return decision

    def request_join(self, candidates, settings, identity, want, timeout):
        """A new server: ask the job at `candidates` ((host, port), any member) to take it in at its
        next step; returns the decision, or raises ValueError (refused: its reason) or RuntimeError
        (no answer: the job is not there, or its key is not this server's)."""
        with self.lock:  # (asked again after a growth that did not form: a new request)
            self.nonce, self.decisions, self.refusal = os.urandom(6).hex(), [], None
            self.envelope.sender = f"join-{self.nonce}"
        entry = {"address": list(self.address), "pid": job_pid(), "host": socket.gethostname()}
        request = Join(self.nonce, want, settings, entry, identity)
        if not any(t.name == "membership-receive" for t in threading.enumerate()):
            self.thread(self._receive)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for candidate in candidates:
                try:
                    self.sock.sendto(self.envelope.seal(request), candidate)
                except OSError:
                    pass
            for _ in range(20):
                if self.refusal is not None:
                    raise ValueError(self.refusal)
                with self.lock:
                    found = [(job, d) for job, d in self.decisions if self.nonce in d.joined]
                if found:
                    job, decision = found[0]
                    with self.lock:
                        self.move(State.GROWING)  # (the group forms in join(); then it trains)
                    self.me, self.token = decision.joined[self.nonce], job
                    self.envelope.sender, self.envelope.job = self.me, job
                    self.book = {int(m): entry for m, entry in decision.book.items()}
                    self.members, self.generation = decision.members, decision.g - 1
                    return decision
                time.sleep(0.01)
        raise RuntimeError(f"no member of a job answered within {timeout:g} s")
