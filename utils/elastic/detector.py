"""The failure detector: heartbeats beside gloo on a small UDP socket, and fencing.

Why this long: the beats and the inbox are one conversation: what a beat says (the generation,
the state, a report, the decision this rank leads) follows from what the inbox heard, and both
end a generation the same way (break_).

Every heartbeat/5 seconds each rank tells every member "alive, generation g"; a member not heard
for `heartbeat` seconds is taken for silent (SIGSTOP, a cut link, a frozen server). A generation
ends (break_()) when gloo reports an error, when a member falls silent, or when a member says its
generation has ended. Ending it shuts down every TCP connection of this process
(cut_connections): gloo's waits on them fail at once, on this rank and on every peer blocked on
it, so no rank waits out --timeout. A member of an older generation that speaks up is told it was
fenced out (FencedOut). A question from train.py --status is answered (Ask, Status), and a
request from train.py --stop handed to the process (Stop, Stopping: request_stop).

Every datagram is opened by utils/elastic/wire.py before anything reads it: one that fails a
check is dropped and counted in `rejected`, by the check it failed. A table maps each kind to its
handler (a join's kinds to the handlers the growth gave: route()); nothing a handler raises leaves
the receiving thread, and a thread that dies anyway ends the process with one line (guarded).

Who is in is the roster's (utils/elastic/roster.py); what the others' beats report while they
recover goes into the agreement's Ballot (utils/elastic/agreement.py), which its own beats carry.
"""

import collections
import os
import socket
import threading
import time

from utils.elastic import agreement, status
from utils.elastic.agreement import Fenced, State
from utils.elastic.sockets import cut_connections
from utils.elastic.wire import Alive, Ask, Decision, Envelope, FencedOut, Rejected, Stop, Stopping
from utils.errors import EXIT_LOST_PEER
from utils.observe.instruments import OFF
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


class ThreadClocks:
    """The CPU seconds each of the detector's threads has used so far, by name ("beat", "receive"):
    what the control plane costs (bench/fuzz/control_cost.py reads them in the event that
    utils/elastic/join.report_dropped logs)."""

    def __init__(self):
        self.seconds = {}

    def note(self, name):
        self.seconds[name] = time.thread_time()


class Detector:
    """A rank's heartbeats and inbox, on its own UDP socket. roster: who is in (utils/elastic/roster.py,
    shared with the agreement and the growth, and its lock); ballot: the agreement's state, which
    its beats carry while recovering and into which it puts what the others' beats report
    (utils/elastic/agreement.Ballot); key: the job's key (bytes); instruments: where a break is
    logged (utils/observe/instruments.py); cpu: its threads' clocks (ThreadClocks); request_stop(reason):
    what a Stop from train.py --stop asks of this process (utils.setup.stop.request; None: a Stop
    is dropped)."""

    def __init__(self, roster, ballot, heartbeat, address, key, port=0, instruments=OFF, cpu=None, request_stop=None):
        self.roster, self.ballot, self.heartbeat = roster, ballot, heartbeat
        self.instruments, self.cpu, self.request_stop = instruments, cpu or ThreadClocks(), request_stop
        self.envelope = Envelope(key, roster.me)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:  # the job's port + this rank: where a joining server looks (utils/elastic/join.py)
            self.sock.bind((address, port))
        except OSError:
            self.sock.bind((address, 0))
        self.address = self.sock.getsockname()
        self.peers = {}  # id -> a UDP socket connected to it (sees refusals)
        self.heard, self.refused = {}, set()  # id -> when it was last heard; ids whose port refused
        self.decisions = []  # (job, wire.Decision) received in this generation
        self.announcing = None  # the decision this rank leads: its beats send it again until it forms
        self.awaiting = None  # a joining server: its request's nonce (a decision naming it is taken)
        self.broken, self.reason, self.lost = threading.Event(), None, None  # why it ended; who was lost
        self.cut_at = 0.0  # when break_ last cut the connections
        self.fenced_at, self.fenced_heard = None, None  # the generation that went on without this rank; when told
        self.rejected = collections.Counter()  # datagrams dropped, by the check they failed
        self.carried = None  # this rank's utils.elastic.status.Record, which its beats carry (carry())
        self.progress_of = {}  # id -> the last progress each member's beats carried (train.py --status)
        self.routes = {}  # kind -> the handler another part gave for it (route())

    def route(self, kind, handler):
        """Datagrams of `kind` (a wire message class) go to handler(sender, job, message)."""
        self.routes[kind] = handler

    def carry(self, record):
        """This rank's progress (a utils.elastic.status.Record): its beats carry its snapshot."""
        self.carried = record

    def start(self, token):
        """Begin: the roster holds the job's members and book; beats and inbox from now on."""
        self.envelope.job = token
        now = time.monotonic()
        self.heard = {m: now for m in self.roster.members}
        for target in (self._receive, self._beat):
            self.thread(target)

    def start_beating(self):
        """A joined server: heartbeats from now on (its receiver runs since it asked to join)."""
        now = time.monotonic()
        self.heard = {m: now for m in self.roster.members}
        self.thread(self._beat)

    def listen(self):
        """The receiver, if it does not run yet (a joining server's, before it is a member)."""
        if not any(t.name == "membership-receive" for t in threading.enumerate()):
            self.thread(self._receive)

    def thread(self, target):
        name = f"membership-{target.__name__[1:]}"
        threading.Thread(target=guarded(target, self.roster.me), name=name, daemon=True).start()

    def sign_as(self, sender, job=None):
        """Seal from now on as `sender` (and for `job`, if given): a joining server's name changes."""
        self.envelope.sender = sender
        if job is not None:
            self.envelope.job = job

    def send_to(self, address, message, to=None):
        """One datagram to an address that is not a member's (a joining server's); OSError passes."""
        self.sock.sendto(self.envelope.seal(message, to=to), address)

    def announce(self, decision):
        """The decision this rank leads: sent now, and with every beat until its group forms."""
        with self.roster.lock:
            self.announcing = decision
        self.send_decision(decision)  # now, not only with the next beat: a leader that stops (--no-recover) leaves

    def stop_announcing(self):
        """(Under the lock) an agreement begins again: the decision this rank led is void."""
        self.announcing = None

    def await_decision(self, nonce):
        """(Under the lock) a joining server's new request: a decision that names `nonce` is taken
        from a non-member; the decisions heard before it are forgotten."""
        self.awaiting, self.decisions = nonce, []

    def silences(self, now):
        """{member: seconds since it was last heard} (under the lock)."""
        return {m: now - t for m, t in self.heard.items()}

    def begin_generation(self, members, changed):
        """(Under the lock) a generation of `members` formed; `changed`: ids with a new book entry."""
        for member in changed:
            if member in self.peers:
                self.peers.pop(member).close()
        self.refused -= set(members)
        self.decisions, self.lost, self.announcing = [], None, None
        now = time.monotonic()
        self.heard = {m: now for m in members}
        self.broken.clear()

    def dropped(self):
        """One line on the datagrams this rank dropped, or None if it dropped none."""
        if not self.rejected:
            return None
        counts = ", ".join(f"{n:,} {why}" for why, n in self.rejected.most_common())
        return (
            f"rank {self.roster.me}: dropped {sum(self.rejected.values()):,} control datagrams that failed a check "
            f"({counts})"
        )

    # -- the threads ---------------------------------------------------------------------------
    def send(self, member, message):
        """One datagram to a member; a refused port means its process is gone."""
        roster = self.roster
        peer = self.peers.get(member)
        if peer is None:
            peer = self.peers[member] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            peer.connect(tuple(roster.book[member]["address"]))
        try:
            peer.send(self.envelope.seal(message, to=member))
        except ConnectionRefusedError:  # nothing listens there any more: the process is gone
            with roster.lock:
                self.refused.add(member)
            if member in roster.members and roster.state == State.TRAINING:
                self.break_(f"rank {member} is gone (its port refused)", lost=member)
            elif member in roster.forming:  # a member of the group being formed is gone: its waits end now
                cut_connections()
        except OSError:
            pass

    def send_decision(self, decision):
        """A decision this rank leads, to its members (its joiners into the book first)."""
        book = self.roster.book
        for member in decision.joined.values():  # into the book now: a joiner that died refuses
            entry = decision.book[str(member)]
            if book.get(member) != entry:
                book[member] = entry
                if member in self.peers:
                    self.peers.pop(member).close()
        for member in decision.members:
            if member != self.roster.me:
                self.send(member, decision)

    def _beat(self):
        sent = 0.0
        while True:
            now = time.monotonic()
            with self.roster.lock:
                training = self.roster.state == State.TRAINING
                due = not training or now - sent >= min(0.5, self.heartbeat / 5)
                message = self._alive() if due else None
                targets = [m for m in self.roster.members if m != self.roster.me]
                decision = self.announcing
            if due:
                sent = now
                for member in targets:
                    self.send(member, message)
                if decision is not None:
                    self.send_decision(decision)
            if training:  # looked at more often than beats are sent: silence is noticed within 0.1 s of it
                self._look_for_silence(targets, now)
            if self.fenced_at is not None and now - self.fenced_heard > FENCED_EXIT_SECONDS:
                self._exit_fenced()
            self.cpu.note("beat")
            time.sleep(TRAINING_LOOK if training and not self.broken.is_set() else RECOVERY_BEAT)

    def _alive(self):
        """This rank's beat (under the lock): its generation and state, its report while it recovers,
        the member it lost, and its progress."""
        roster, ballot = self.roster, self.ballot
        report = ballot.report if roster.state == State.RECOVERING else None
        mine = self.progress_of[roster.me] = self.carried.snapshot() if self.carried else None
        return Alive(roster.generation, roster.state.value, report, ballot.attempt, self.lost, mine)

    def _look_for_silence(self, targets, now):
        silent = [m for m in targets if now - self.heard.get(m, now) > self.heartbeat]
        if silent:
            self.break_(f"rank {silent[0]} was silent for {self.heartbeat:g} s", lost=silent[0])
        if self.broken.is_set() and now - self.cut_at > CUT_AGAIN_SECONDS:
            self.cut_at = now  # (a rank woken by SIGCONT may sit in a wait on a pair made after the cut)
            cut_connections()

    def _exit_fenced(self):
        """The last resort of a fenced rank whose main thread stays in a wait that no cut ended: it
        holds nothing the job needs (it writes nothing), so it leaves as train.py would have."""
        os.write(2, f"train.py: rank {self.roster.me}: {Fenced(self.fenced_at)}\n".encode())
        release()
        os._exit(EXIT_LOST_PEER)

    def _receive(self):
        handlers = {Alive: self._on_alive, Decision: self._on_decision, FencedOut: self._on_fenced}
        answered = {Ask: self._on_ask, Stop: self._on_stop}
        while True:
            try:
                datagram, source = self.sock.recvfrom(65536)
            except OSError:
                continue
            try:
                sender, job, message = self.envelope.open(datagram)
                handler = handlers.get(type(message)) or self.routes.get(type(message))
                if type(message) in answered:  # (answered where it came from)
                    answered[type(message)](sender, job, message, source)
                elif handler is not None:
                    handler(sender, job, message)
                else:  # a kind only a non-member takes (an answer to train.py --status or --stop)
                    self.rejected["not for a member"] += 1
            except Rejected as e:
                self.rejected[str(e)] += 1
            except Exception:  # noqa: BLE001 (checked, yet it failed: count it; the thread goes on)
                self.rejected["failed in its handler"] += 1
            self.cpu.note("receive")

    def from_member(self, sender, job):
        """Whether a datagram is a member's of this job: counts it heard if so."""
        if job != self.roster.token or type(sender) is not int:
            self.rejected["another job"] += 1
            return False
        with self.roster.lock:
            self.heard[sender] = time.monotonic()
            self.refused.discard(sender)
        return True

    def _on_alive(self, sender, job, message):
        if not self.from_member(sender, job):
            return
        roster = self.roster
        with roster.lock:
            current, members, state = roster.generation, roster.members, roster.state
            if message.progress is not None:
                self.progress_of[sender] = message.progress
            if message.state == State.RECOVERING.value:
                self.ballot.heard(sender, message.g, message.attempt, message.report, message.lost)
        if agreement.must_fence(message.g, current, sender, members):
            self.send(sender, FencedOut(current))  # it missed a generation: tell it
        elif message.g == current and message.state == "recovering" and state in (State.TRAINING, State.GROWING):
            self.break_(f"rank {sender} lost a peer")
        elif message.g > current and state == State.TRAINING:
            self.break_(f"rank {sender} is at a newer generation")  # then the agreement finds out

    def _on_decision(self, sender, job, message):
        joiner = self.awaiting is not None and self.awaiting in message.joined
        if not joiner and not self.from_member(sender, job):
            return
        with self.roster.lock:
            self.decisions.append((job, message))

    def _on_fenced(self, sender, job, message):
        if not self.from_member(sender, job):
            return
        with self.roster.lock:
            if message.g > self.roster.generation and self.fenced_at is None:
                self.fenced_at, self.fenced_heard = message.g, time.monotonic()
                self.roster.move(State.FENCED)
        if self.fenced_at is not None:
            self.break_("the job went on without this rank")

    def _on_ask(self, sender, _job, message, source):
        """train.py --status (utils/elastic/status.py): every member's progress, to the asker's address."""
        if sender != f"status-{message.nonce}":
            self.rejected["sender"] += 1
            return
        roster = self.roster
        with roster.lock:
            if roster.me not in roster.members:  # a server still joining: a member answers instead
                return
            answer = status.answer(message.nonce, roster, self.heard, self.progress_of, time.monotonic())
        self._answer(answer, sender, source)

    def _on_stop(self, sender, job, message, source):
        """train.py --stop (utils/elastic/stopper.py): this process asks for the job's stop as on a
        first SIGTERM (every rank stops after the same step, saved), and tells the stopper."""
        if sender != f"stop-{message.nonce}":
            self.rejected["sender"] += 1
        elif job != self.roster.token:  # sealed for an earlier run of the job, and replayed
            self.rejected["another job"] += 1
        elif self.request_stop is None:
            self.rejected["no stop here"] += 1
        elif self.roster.me in self.roster.members:  # (a server still joining: no answer; it is not in the job yet)
            self.request_stop(f"train.py --stop from {source[0]}")
            self._answer(Stopping(message.nonce), sender, source)

    def _answer(self, message, to, source):
        """An answer to a non-member, at the address it came from."""
        try:
            self.sock.sendto(self.envelope.seal(message, to=to), source)
        except OSError:  # (too large for a datagram, or the asker's address is unreachable)
            self.rejected["answer not sent"] += 1

    # -- ending a generation ---------------------------------------------------------------------
    def break_(self, reason, lost=None):
        """End this generation: note why, and cut every connection (once)."""
        with self.roster.lock:
            if self.broken.is_set():
                return
            self.reason, self.lost = reason, lost
            self.broken.set()
            self.instruments.log(event="break", reason=reason, g=self.roster.generation)
            self.cut_at = time.monotonic()
        cut_connections()
