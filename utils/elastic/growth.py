"""Taking a new server in (--join): Membership's side of a running job's growth.

    request_join(candidates, settings, want, timeout)    the new server asks any member
    _on_join(message)                                    a member passes the request to the leader
    wants_growth()                                       the leader raises the join flag with a step's sum
    grow(report, timeout)                                at that step, the leader decides the next generation

Membership (utils/elastic/membership.py) is a Growth: the state these methods use (the lock,
the book of members, the socket) is the membership's own.
"""

import json
import os
import socket
import threading
import time

import torch.distributed as dist

from utils.outputs import job_pid


class Growth:
    """The join half of Membership (see membership.py for the fields it shares)."""

    def _on_join(self, message):
        """A join request (utils/elastic/recovery.py: --join): the leader takes it, any other member passes it on."""
        with self.lock:
            leader = self.members[0] if self.members else None
            if leader is None or self.state != "training":
                return
        if leader != self.me:
            self._send(leader, message)
            return
        theirs, joiner = message.get("settings") or {}, tuple(message["entry"]["address"])
        for name, value in (self.settings or {}).items():
            if theirs.get(name) != value:
                reply = {
                    "t": "refused",
                    "nonce": message["nonce"],
                    "reason": f"the job has --{name} {value}, "
                    f"this server has {theirs.get(name)}; join with the job's settings",
                }
                self.sock.sendto(json.dumps(reply).encode(), joiner)
                return
        with self.lock:
            self.joining[message["nonce"]] = dict(message, heard=time.monotonic())  # it asks again every 0.2 s

    def forget_joiners(self, decision):
        """A growth that failed: its joiners (all, if it decided nothing) must ask again; one that
        died meanwhile would otherwise fail every growth after it."""
        with self.lock:
            for nonce in decision["joined"] if decision else list(self.joining):
                self.joining.pop(nonce, None)

    def wants_growth(self):
        """The leader has a server waiting to join (it rides in the stop flag: utils/run.py)."""
        return bool(self.fresh_joiners()) and self.members[0] == self.me

    def fresh_joiners(self):
        """The join requests heard in the last 2 s: a server that stopped asking is gone or in."""
        with self.lock:
            return [r for r in self.joining.values() if time.monotonic() - r["heard"] < 2.0]

    def grow(self, report, timeout):
        """Every member, at the step boundary whose sum said a server waits: the next generation,
        the members and the waiting servers (the leader decides; the others wait for it)."""
        generation = self.generation
        with self.lock:
            self.state = "growing"
        if self.members[0] == self.me:
            return self._decide_growth(report)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.broken.is_set():  # (a member lost meanwhile: agree)
            with self.lock:
                found = [
                    d
                    for d in self.decisions
                    if d["g"] > generation and self.me in d["members"] and d.get("attempt") is None
                ]  # a growth's decision, not a recovery's
            if found:
                return found[-1]
            time.sleep(0.01)
        with self.lock:
            self.state = "training"
        raise RuntimeError(f"rank {self.members[0]} decided nothing within {timeout:g} s")

    def _decide_growth(self, report):
        waiting = self.fresh_joiners()
        book = {str(m): entry for m, entry in self.book.items()}
        joined, members = {}, list(self.members)
        for request in waiting:
            want, taken = request.get("want"), {int(m) for m in book} | set(joined.values())
            member = want if want is not None and want not in members else max(taken) + 1  # its old rank if free
            joined[request["nonce"]] = member
            book[str(member)] = request["entry"]
            members.append(member)
        store = dist.TCPStore(self.book[self.me]["address"][0], 0, is_master=True, wait_for_workers=False)
        decision = {
            "t": "decision",
            "g": self.generation + 1,
            "name": f"{self.generation + 1}.{self.me}.{os.urandom(4).hex()}",
            "members": members,
            "store": [self.book[self.me]["address"][0], store.port],
            "source": self.me,
            "position": list(report),
            "book": book,
            "joined": joined,
        }
        with self.lock:
            self.sending, self.leader_store = decision, store
        self._send_decision(decision)
        return decision

    def request_join(self, candidates, settings, want, timeout):
        """A new server: ask the job at `candidates` ((host, port), any member) to take it in at its
        next step; returns the decision, or raises RuntimeError (refused: its reason; or no answer)."""
        with self.lock:  # (asked again after a growth that did not form: a new request)
            self.nonce, self.decisions, self.refusal = os.urandom(6).hex(), [], None
        request = {
            "t": "join",
            "nonce": self.nonce,
            "want": want,
            "settings": settings,
            "entry": {"address": list(self.address), "pid": job_pid(), "host": socket.gethostname()},
        }
        if not any(t.name == "membership-receive" for t in threading.enumerate()):
            threading.Thread(target=self._receive, name="membership-receive", daemon=True).start()
        deadline, wire = time.monotonic() + timeout, json.dumps(request).encode()
        while time.monotonic() < deadline:
            for candidate in candidates:
                try:
                    self.sock.sendto(wire, candidate)
                except OSError:
                    pass
            for _ in range(20):
                if self.refusal is not None:
                    raise ValueError(self.refusal)
                with self.lock:
                    found = [d for d in self.decisions if self.nonce in d.get("joined", {})]
                if found:
                    decision = found[0]
                    self.me, self.token = decision["joined"][self.nonce], decision["job"]
                    self.book = {int(m): entry for m, entry in decision["book"].items()}
                    self.members, self.generation = decision["members"], decision["g"] - 1
                    return decision
                time.sleep(0.01)
        raise RuntimeError(f"no member of a job answered within {timeout:g} s")
