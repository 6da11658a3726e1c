"""The failure detector: heartbeats beside gloo on a small UDP socket, and fencing.

Every heartbeat/5 seconds each rank tells every member "alive, generation g"; a member not heard
for `heartbeat` seconds is taken for silent (SIGSTOP, a cut link, a frozen server). A generation
ends (break_()) when gloo reports an error, when a member falls silent, or when a member says its
generation has ended. Ending it shuts down every TCP connection of this process
(cut_connections): gloo's waits on them fail at once, on this rank and on every peer blocked on
it, so no rank waits out --timeout. A member of an older generation that speaks up is told it was
fenced out (FencedOut).

Every datagram is opened by utils/elastic/wire.py before anything reads it: one that fails a
check is dropped and counted in `rejected`, by the check it failed. A table maps each kind to its
handler; nothing a handler raises leaves the receiving thread, and a thread that dies anyway
ends the process with one line (guarded).
"""

import collections
import os
import socket
import threading
import time

from utils.elastic import agreement, faults, status
from utils.elastic.agreement import Fenced, State
from utils.elastic.sockets import cut_connections
from utils.elastic.wire import Alive, Ask, Decision, Envelope, FencedOut, Join, Refused, Rejected
from utils.errors import EXIT_LOST_PEER
from utils.store.outputs import release

RECOVERY_BEAT = 0.05  # seconds between messages while recovering
TRAINING_LOOK = 0.1  # seconds between looks for silence while training (beats go every heartbeat/5, at most 0.5)
CUT_AGAIN_SECONDS = 0.5  # broken, but the main thread still trains: cut what was made (or missed) since
FENCED_EXIT_SECONDS = 5.0  # told it was fenced out, and still not out of a wait: exit from here


def guarded(target, me):
    """A thread's body that can never die silently: a slip ends the process with one line."""

    def run():
        try:
            target()
        except BaseException as e:  # noqa: BLE001 (a bug here must not leave a job without a detector)
            os.write(2, f"train.py: rank {me}: the membership's thread failed: {type(e).__name__}: {e}\n".encode())
            release()
            os._exit(EXIT_LOST_PEER)

    return run


class Detector:
    """A rank's heartbeats and inbox (the fields below are the membership's too: Membership derives
    from Detector and Growth). `me` is the rank's id for the whole job: its rank in the first
    generation. `key`: the job's key (bytes)."""

    def __init__(self, me, heartbeat, address, key, port=0):
        self.me, self.heartbeat = me, heartbeat
        self.envelope = Envelope(key, me)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:  # the job's port + this rank: where a joining server looks (utils/elastic/join.py)
            self.sock.bind((address, port))
        except OSError:
            self.sock.bind((address, 0))
        self.address = self.sock.getsockname()
        self.lock = threading.Lock()
        self.book, self.token = {}, None  # id -> {"address", "pid", "host"}; the job's random id
        self.generation, self.members = 0, []
        self.state = State.TRAINING
        self.report = None  # while recovering: this rank's position
        self.heard, self.refused, self.reports = {}, set(), {}
        self.named = {}  # rank -> generation in which a survivor saw it fall silent
        self.attempt = 0  # while recovering: how many decisions did not form
        self.decisions, self.sending = [], None  # decisions received; the one this leader sends
        self.fenced_at = None  # the generation that went on without this rank
        self.broken, self.reason, self.lost = threading.Event(), None, None  # why it ended; who was lost
        self.cut_at = 0.0  # when break_ last cut the connections
        self.peers = {}  # id -> a UDP socket connected to it (sees refusals)
        self.settings, self.identity = None, None  # what a joining server must have alike
        self.joining = {}  # the leader: nonce -> join request of a server waiting to join
        self.nonce, self.refusal = None, None  # a joining server: its request's nonce; why it was refused
        self.forming = ()  # while join() forms a group: its members
        self.rejected = collections.Counter()  # datagrams dropped, by the check they failed
        self.cpu = {}  # thread -> its CPU seconds so far (bench/fuzz/control_cost.py reads them)
        self.progress = None  # this rank's utils.elastic.status.Record (utils/run.py sets it): its beats carry it
        self.progress_of = {}  # id -> the last progress each member's beats carried (train.py --status)
        self.book_file = None  # the checkpoint beside which the members' addresses are kept (utils/elastic/rejoin.py)

    def start(self, book, token):
        """Begin: `book` maps every id to its address (this rank's `address` among them)."""
        self.book, self.token, self.envelope.job = book, token, token
        self.members = sorted(book)
        now = time.monotonic()
        self.heard = {m: now for m in self.members}
        for target in (self._receive, self._beat):
            self.thread(target)

    def start_beating(self):
        """A joined server: heartbeats from now on (its receiver runs since request_join)."""
        now = time.monotonic()
        self.heard = {m: now for m in self.members}
        self.thread(self._beat)

    def thread(self, target):
        name = f"membership-{target.__name__[1:]}"
        threading.Thread(target=guarded(target, self.me), name=name, daemon=True).start()

    def move(self, to):
        """The one place the state changes (under the lock)."""
        self.state = agreement.move(self.state, to)

    def dropped(self):
        """One line on the datagrams this rank dropped, or None if it dropped none."""
        if not self.rejected:
            return None
        counts = ", ".join(f"{n:,} {why}" for why, n in self.rejected.most_common())
        return (
            f"rank {self.me}: dropped {sum(self.rejected.values()):,} control datagrams that failed a check ({counts})"
        )

    def rank_of(self, member):
        return self.members.index(member)

    # -- the threads ---------------------------------------------------------------------------
    def _send(self, member, message):
        peer = self.peers.get(member)
        if peer is None:
            peer = self.peers[member] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            peer.connect(tuple(self.book[member]["address"]))
        try:
            peer.send(self.envelope.seal(message, to=member))
        except ConnectionRefusedError:  # nothing listens there any more: the process is gone
            with self.lock:
                self.refused.add(member)
            if member in self.members and self.state == State.TRAINING:
                self.break_(f"rank {member} is gone (its port refused)", lost=member)
            elif member in self.forming:  # a member of the group being formed is gone: its waits end now
                cut_connections()
        except OSError:
            pass

    def _beat(self):
        sent = 0.0
        while True:
            now = time.monotonic()
            with self.lock:
                training = self.state == State.TRAINING
                due = not training or now - sent >= min(0.5, self.heartbeat / 5)
                if due:
                    report = self.report if self.state == State.RECOVERING else None
                    mine = self.progress_of[self.me] = self.progress.snapshot() if self.progress else None
                    message = Alive(self.generation, self.state.value, report, self.attempt, self.lost, mine)
                targets = [m for m in self.members if m != self.me]
                decision = self.sending
            if due:
                sent = now
                for member in targets:
                    self._send(member, message)
                if decision is not None:
                    self._send_decision(decision)
            if training:  # looked at more often than beats are sent: silence is noticed within 0.1 s of it
                silent = [m for m in targets if now - self.heard.get(m, now) > self.heartbeat]
                if silent:
                    self.break_(f"rank {silent[0]} was silent for {self.heartbeat:g} s", lost=silent[0])
                if self.broken.is_set() and now - self.cut_at > CUT_AGAIN_SECONDS:
                    self.cut_at = now  # (a rank woken by SIGCONT may sit in a wait on a pair made after the cut)
                    cut_connections()
            if self.fenced_at is not None and now - self.fenced_heard > FENCED_EXIT_SECONDS:
                self._exit_fenced()
            self.cpu["beat"] = time.thread_time()
            time.sleep(TRAINING_LOOK if training and not self.broken.is_set() else RECOVERY_BEAT)

    def _exit_fenced(self):
        """The last resort of a fenced rank whose main thread stays in a wait that no cut ended: it
        holds nothing the job needs (it writes nothing), so it leaves as train.py would have."""
        os.write(2, f"train.py: rank {self.me}: {Fenced(self.fenced_at)}\n".encode())
        release()
        os._exit(EXIT_LOST_PEER)

    def _receive(self):
        handlers = {
            Alive: self._on_alive,
            Decision: self._on_decision,
            FencedOut: self._on_fenced,
            Join: self._on_join,
            Refused: self._on_refused,
        }
        while True:
            try:
                datagram, source = self.sock.recvfrom(65536)
            except OSError:
                continue
            try:
                sender, job, message = self.envelope.open(datagram)
                if type(message) is Ask:  # (answered where it came from)
                    self._on_ask(sender, message, source)
                elif type(message) in handlers:
                    handlers[type(message)](sender, job, message)
                else:  # a kind only a non-member takes (an answer to train.py --status)
                    self.rejected["not for a member"] += 1
            except Rejected as e:
                self.rejected[str(e)] += 1
            except Exception:  # noqa: BLE001 (checked, yet it failed: count it; the thread goes on)
                self.rejected["failed in its handler"] += 1
            self.cpu["receive"] = time.thread_time()

    def from_member(self, sender, job):
        """Whether a datagram is a member's of this job: counts it heard if so."""
        if job != self.token or type(sender) is not int:
            self.rejected["another job"] += 1
            return False
        with self.lock:
            self.heard[sender] = time.monotonic()
            self.refused.discard(sender)
        return True

    def _on_alive(self, sender, job, message):
        if not self.from_member(sender, job):
            return
        with self.lock:
            current, members, state = self.generation, self.members, self.state
            if message.progress is not None:
                self.progress_of[sender] = message.progress
            if message.state == State.RECOVERING.value:
                self.reports[sender] = (message.g, message.attempt, message.report)
                if message.lost is not None:
                    self.named[message.lost] = message.g  # it saw that rank fall silent
        if agreement.must_fence(message.g, current, sender, members):
            self._send(sender, FencedOut(current))  # it missed a generation: tell it
        elif message.g == current and message.state == "recovering" and state in (State.TRAINING, State.GROWING):
            self.break_(f"rank {sender} lost a peer")
        elif message.g > current and state == State.TRAINING:
            self.break_(f"rank {sender} is at a newer generation")  # then the agreement finds out

    def _on_decision(self, sender, job, message):
        joiner = self.nonce is not None and self.nonce in message.joined
        if not joiner and not self.from_member(sender, job):
            return
        with self.lock:
            self.decisions.append((job, message))

    def _on_fenced(self, sender, job, message):
        if not self.from_member(sender, job):
            return
        with self.lock:
            if message.g > self.generation and self.fenced_at is None:
                self.fenced_at, self.fenced_heard = message.g, time.monotonic()
                self.move(State.FENCED)
        if self.fenced_at is not None:
            self.break_("the job went on without this rank")

    def _on_ask(self, sender, message, source):
        """train.py --status (utils/elastic/status.py): every member's progress, to the asker's address."""
        if sender != f"status-{message.nonce}":
            self.rejected["sender"] += 1
            return
        with self.lock:
            if self.me not in self.members:  # a server still joining: a member answers instead
                return
            now = time.monotonic()
            answer = status.answer(
                message.nonce,
                self.generation,
                self.state.value,
                self.members,
                self.book,
                self.heard,
                self.progress_of,
                self.me,
                now,
            )
        try:
            self.sock.sendto(self.envelope.seal(answer, to=sender), source)
        except OSError:  # (too large for a datagram, or the asker's address is unreachable)
            self.rejected["answer not sent"] += 1

    def _on_refused(self, sender, job, message):
        if self.nonce is not None and message.nonce == self.nonce:
            self.refusal = message.reason

    # -- ending a generation, agreeing on the next ------------------------------------------------
    def break_(self, reason, lost=None):
        """End this generation: note why, and cut every connection (once)."""
        with self.lock:
            if self.broken.is_set():
                return
            self.reason, self.lost = reason, lost
            self.broken.set()
            faults.log(event="break", reason=reason, g=self.generation)
            self.cut_at = time.monotonic()
        cut_connections()
