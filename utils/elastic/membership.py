"""Who is in the job: heartbeats beside gloo, and the survivors' agreement when a rank is lost.

    membership = Membership(me, heartbeat, address)       every rank (utils/elastic/join.py)
    membership.start(book, token)                         the ranks' control addresses, exchanged once
    decision = membership.agree(report)                   after a lost peer: who goes on, from where
    membership.join(decision, timeout)                    the survivors' new default process group

Each rank keeps a small UDP socket on gloo's card. Every heartbeat/5 seconds it tells every
member "alive, generation g"; a member not heard for `heartbeat` seconds is taken for silent
(SIGSTOP, a cut link, a frozen server). A generation ends (break_()) when gloo reports an error,
when a member falls silent, or when a member says its generation has ended. Ending it shuts
down every TCP connection of this process (cut_connections): gloo's waits on them fail at once,
on this rank and on every peer blocked on it, so no rank waits out --timeout. A rank whose
connections were cut can neither send into the survivors' buffers nor take part in a step.

The agreement, on every rank that is still running:

    every rank:  "recovering g, my position (epoch, step)"   to every member, every 50 ms
    a member is gone when its port refuses (a killed process), or it stays silent
    the leader (the lowest rank that is not gone), once every member has answered or is gone:
        quorum?  more than half of generation g, or exactly half with g's lowest rank
        no:      raise NoQuorum: nobody goes on on this side (no split brain)
        yes:     host a store, send "generation g+1: these members, this store, this source"
    every member of g+1: a new gloo group on that store (join); the source's state goes to all

A member of an older generation that speaks up (a frozen server woken by SIGCONT) is told it
was fenced out; it stops (Fenced) without writing anything: the survivors own the checkpoint.
"""

import datetime
import json
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from utils.elastic import faults
from utils.elastic.growth import Growth
from utils.elastic.sockets import cut_connections
from utils.errors import EXIT_LOST_PEER
from utils.outputs import release

SETTLE_SECONDS = 1.0  # every live member answers within this; a silent one is gone after it
RECOVERY_BEAT = 0.05  # seconds between messages while recovering
MAX_AGREE_SECONDS = 60.0  # an agreement that takes longer is given up (NoQuorum)
CUT_AGAIN_SECONDS = 0.5  # broken, but the main thread still trains: cut what was made (or missed) since
FENCED_EXIT_SECONDS = 5.0  # told it was fenced out, and still not out of a wait: exit from here


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
            f"survivors hold the job's checkpoint); restart this server's command to start a job afresh"
        )


def has_quorum(alive, members):
    """More than half of `members` (in rank order), or exactly half holding their rank 0."""
    alive = set(alive) & set(members)
    return 2 * len(alive) > len(members) or (2 * len(alive) == len(members) and members[0] in alive)


class Membership(Growth):
    """This rank's view of the job (see the module's docstring). `me` is the rank's id for the
    whole job: its rank in the first generation."""

    def __init__(self, me, heartbeat, address, port=0):
        self.me, self.heartbeat = me, heartbeat
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:  # the job's port + this rank: where a joining server looks (utils/elastic/join.py)
            self.sock.bind((address, port))
        except OSError:
            self.sock.bind((address, 0))
        self.address = self.sock.getsockname()
        self.lock = threading.Lock()
        self.book, self.token = {}, None  # id -> {"address", "pid", "host"}; the job's random id
        self.generation, self.members = 0, []
        self.state = "training"  # or "recovering"
        self.report = None  # while recovering: this rank's position
        self.heard, self.refused, self.reports = {}, set(), {}
        self.named = {}  # rank -> generation in which a survivor saw it fall silent
        self.attempt = 0  # while recovering: how many decisions did not form
        self.decisions, self.sending = [], None  # decisions received; the one this leader sends
        self.fenced_at = None  # the generation that went on without this rank
        self.broken, self.reason, self.lost = threading.Event(), None, None  # why it ended; who was lost
        self.cut_at = 0.0  # when break_ last cut the connections
        self.peers = {}  # id -> a UDP socket connected to it (sees refusals)
        self.settings = None  # what a joining server must have alike (Config.must_agree)
        self.joining = {}  # the leader: nonce -> join request of a server waiting to join
        self.nonce, self.refusal = None, None  # a joining server: its request's nonce; why it was refused
        self.forming = ()  # while join() forms a group: its members

    def start(self, book, token):
        """Begin: `book` maps every id to its address (this rank's `address` among them)."""
        self.book, self.token = book, token
        self.members = sorted(book)
        now = time.monotonic()
        self.heard = {m: now for m in self.members}
        for target in (self._receive, self._beat):
            threading.Thread(target=target, name=f"membership-{target.__name__[1:]}", daemon=True).start()

    def rank_of(self, member):
        return self.members.index(member)

    # -- the threads ---------------------------------------------------------------------------
    def _send(self, member, message):
        peer = self.peers.get(member)
        if peer is None:
            peer = self.peers[member] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            peer.connect(tuple(self.book[member]["address"]))
        try:
            peer.send(json.dumps(dict(message, job=self.token, id=self.me)).encode())
        except ConnectionRefusedError:  # nothing listens there any more: the process is gone
            with self.lock:
                self.refused.add(member)
            if member in self.members and self.state == "training":
                self.break_(f"rank {member} is gone (its port refused)", lost=member)
            elif member in self.forming:  # a member of the group being formed is gone: its waits end now
                cut_connections()
        except OSError:
            pass

    def _beat(self):
        sent = 0.0
        while True:
            with self.lock:
                message = {
                    "t": "alive",
                    "g": self.generation,
                    "state": self.state,
                    "report": self.report,
                    "attempt": self.attempt,
                    "lost": self.lost,
                }
                targets = [m for m in self.members if m != self.me]
                decision, training = self.sending, self.state == "training"
            now = time.monotonic()
            if not training or now - sent >= min(0.5, self.heartbeat / 5):
                sent = now
                for member in targets:
                    self._send(member, message)
                if decision is not None:
                    self._send_decision(decision)
            if training:  # looked at more often than beats are sent: silence is noticed within 0.05 s of it
                silent = [m for m in targets if now - self.heard.get(m, now) > self.heartbeat]
                if silent:
                    self.break_(f"rank {silent[0]} was silent for {self.heartbeat:g} s", lost=silent[0])
                if self.broken.is_set() and now - self.cut_at > CUT_AGAIN_SECONDS:
                    self.cut_at = now  # (a rank woken by SIGCONT may sit in a wait on a pair made after the cut)
                    cut_connections()
            if self.fenced_at is not None and now - self.fenced_heard > FENCED_EXIT_SECONDS:
                self._exit_fenced()
            time.sleep(RECOVERY_BEAT)

    def _exit_fenced(self):
        """The last resort of a fenced rank whose main thread stays in a wait that no cut ended: it
        holds nothing the job needs (it writes nothing), so it leaves as train.py would have."""
        os.write(2, f"train.py: rank {self.me}: {Fenced(self.fenced_at)}\n".encode())
        release()
        os._exit(EXIT_LOST_PEER)

    def _receive(self):
        while True:
            try:
                data, _ = self.sock.recvfrom(65536)
                message = json.loads(data)
            except (OSError, ValueError):
                continue
            kind = message.get("t")
            if kind == "join":
                self._on_join(message)
                continue
            mine = self.nonce is not None and (
                message.get("nonce") == self.nonce or self.nonce in message.get("joined", {})
            )
            if message.get("job") != self.token and not mine:
                continue
            if kind == "refused":
                self.refusal = message.get("reason")
                continue
            sender, generation = message.get("id"), message.get("g", -1)
            with self.lock:
                self.heard[sender] = time.monotonic()
                self.refused.discard(sender)
                current, members, state = self.generation, self.members, self.state
                if kind == "alive" and message.get("state") == "recovering":
                    self.reports[sender] = (generation, message.get("attempt"), message.get("report"))
                    if message.get("lost") is not None:
                        self.named[message["lost"]] = generation  # it saw that rank fall silent
                elif kind == "decision":
                    self.decisions.append(message)
                elif kind == "fenced" and message["g"] > current and self.fenced_at is None:
                    self.fenced_at, self.fenced_heard = message["g"], time.monotonic()
            if kind == "fenced" and self.fenced_at is not None:
                self.break_("the job went on without this rank")
            elif kind == "alive" and generation < current and sender not in members:
                self._send(sender, {"t": "fenced", "g": current})  # it missed a generation: tell it
            elif (
                kind == "alive"
                and generation == current
                and message.get("state") == "recovering"
                and state in ("training", "growing")
            ):
                self.break_(f"rank {sender} lost a peer")
            elif kind == "alive" and generation > current and state == "training":
                self.break_(f"rank {sender} is at a newer generation")  # then the agreement finds out

    # -- ending a generation, agreeing on the next ------------------------------------------------
    def break_(self, reason, lost=None):
        """End this generation: note why, and cut every connection (once)."""
        with self.lock:
            if self.broken.is_set():
                return
            self.reason, self.lost = reason, lost
            self.broken.set()
            self.cut_at = time.monotonic()
        cut_connections()

    def agree(self, report, tried=()):
        """Block until this generation's survivors agree; returns the decision (a dict: "g",
        "members", "store", "source", "position", "reports"). Raises NoQuorum or Fenced.
        report: this rank's position, [epoch, step] (the step it last completed)."""
        self.break_("this rank lost a peer")
        started = time.monotonic()
        with self.lock:
            self.state, self.report, self.sending = "recovering", report, None
            self.attempt = attempt = len(tried)  # the survivors' try at forming this generation's successor
        generation, members = self.generation, self.members
        while True:
            with self.lock:
                if self.fenced_at is not None:
                    raise Fenced(self.fenced_at)
                mine = [
                    d
                    for d in self.decisions
                    if d["g"] > generation
                    and self.me in d["members"]
                    and d.get("attempt") == attempt
                    and d["name"] not in tried
                ]
                outsider = [d for d in self.decisions if d["g"] > generation and self.me not in d["members"]]
                reports = {
                    m: r for m, (g, a, r) in self.reports.items() if g == generation and a == attempt and m in members
                }
                reports[self.me] = report
                now, heard, refused = time.monotonic(), dict(self.heard), set(self.refused)
                named = {m for m, g in self.named.items() if g == generation}
            if mine:
                return mine[0]
            if outsider:
                raise Fenced(outsider[0]["g"])
            settled = now - started > SETTLE_SECONDS
            gone = {
                m: why
                for m in members
                if m != self.me
                for why in [
                    "its port refused"
                    if m in refused
                    else f"silent {now - heard.get(m, 0):.1f} s"
                    if settled and now - heard.get(m, 0) > self.heartbeat
                    else "it broke this generation"
                    if m == self.lost and m not in reports
                    else "another rank lost it"
                    if m in named and m not in reports and now - heard.get(m, 0) > min(0.5, self.heartbeat)
                    else None
                ]
                if why
            }  # (a reporter may die too)
            reports = {m: r for m, r in reports.items() if m not in gone}
            pending = [m for m in members if m not in reports and m not in gone]
            if not pending and next(m for m in members if m not in gone) == self.me:
                if has_quorum(reports, members):
                    faults.log(event="agreed", g=generation + 1, attempt=attempt, reports=reports, gone=gone)
                    return self._decide(generation, reports, attempt)
                # too few: give up only once every missing member has been silent for a heartbeat
                # (one that was slow to notice the loss may still report; a refused port is final)
                if all(why != "it broke this generation" and why != "another rank lost it" for why in gone.values()):
                    faults.log(event="no-quorum", g=generation, attempt=attempt, reports=reports, gone=gone)
                    raise NoQuorum(set(reports), members, gone)
            if now - started > MAX_AGREE_SECONDS:
                raise NoQuorum(set(reports), members, gone)
            time.sleep(0.01)

    def _decide(self, generation, reports, attempt):
        """The leader: the next generation's members, store and source (the furthest position)."""
        store = dist.TCPStore(self.book[self.me]["address"][0], 0, is_master=True, wait_for_workers=False)
        members = [m for m in self.members if m in reports]  # in rank order: rank 0 stays first if alive
        furthest = max(tuple(r) for r in reports.values())
        decision = {
            "t": "decision",
            "g": generation + 1,
            "name": f"{generation + 1}.{self.me}.{os.urandom(4).hex()}",
            "members": members,
            "store": [self.book[self.me]["address"][0], store.port],
            "source": next(m for m in members if tuple(reports[m]) == furthest),
            "position": list(furthest),
            "reports": {str(m): reports[m] for m in members},
            "attempt": attempt,
        }
        with self.lock:
            self.sending, self.leader_store = decision, store
        self._send_decision(
            decision
        )  # now, not only with the next beat: a leader that stops (--no-recover) leaves at once
        return decision

    def _send_decision(self, decision):
        for member in decision.get("joined", {}).values():  # into the book now: a joiner that died refuses
            entry = decision["book"][str(member)]
            if self.book.get(member) != entry:
                self.book[member] = entry
                if member in self.peers:
                    self.peers.pop(member).close()
        for member in decision["members"]:
            if member != self.me:
                self._send(member, decision)

    # -- growing: a server joins at a step boundary ---------------------------------------------
    def start_beating(self):
        """A joined server: heartbeats from now on (its receiver runs since request_join)."""
        now = time.monotonic()
        self.heard = {m: now for m in self.members}
        threading.Thread(target=self._beat, name="membership-beat", daemon=True).start()

    def join(self, decision, timeout, gloo_timeout):
        """Form the decided generation's default process group; returns this rank's new rank.
        A RuntimeError if a member does not come within `timeout` (then agree() again)."""
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError, AssertionError):
            pass
        if not dist.is_initialized():  # (after a failed init, torch's group counter stays up: it names the
            dist.distributed_c10d._world.group_count = 0  # store keys, which must match the other members')
        host, port = decision["store"]
        members = decision["members"]
        self.forming = members
        try:
            if decision["members"][0] == self.me and self.sending is decision:
                store = self.leader_store
            else:
                store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(decision["name"], store),
                rank=members.index(self.me),
                world_size=len(members),
                timeout=datetime.timedelta(seconds=timeout),
            )
            dist.barrier()
        finally:
            self.forming = ()
        dist.group.WORLD._get_backend(torch.device("cpu"))._set_default_timeout(
            datetime.timedelta(seconds=gloo_timeout)
        )
        with self.lock:
            self.generation, self.members = decision["g"], members
            for m, entry in decision.get("book", {}).items():
                if self.book.get(int(m)) != entry and int(m) in self.peers:  # a new server under an old rank
                    self.peers.pop(int(m)).close()
                self.book[int(m)] = entry
            self.refused -= set(members)
            for nonce in decision.get("joined", {}):
                self.joining.pop(nonce, None)
            self.state, self.report, self.sending = "training", None, None
            self.reports, self.decisions, self.lost, self.named = {}, [], None, {}
            now = time.monotonic()
            self.heard = {m: now for m in members}
            self.broken.clear()
        return members.index(self.me)
