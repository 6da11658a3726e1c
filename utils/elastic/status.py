"""Watching a running job: each member's progress, and `train.py --status`, which asks for it.

    record = Record(epochs)          a rank's progress; utils/run.py calls record.stepped() after each step
    record.snapshot()                what its heartbeats carry (checks.PROGRESS), read by the beat thread
    answer(nonce, ...)               a member's Status: every member's last progress, in rank order
    ask(host, port, secret)          train.py --status: any member's answer, or None within 5 s
    exchange(...)                    a question sent until its answer comes (--status's, --stop's)
    command(...)                     train.py --status [HOST:PORT] [--json]: prints it; the exit code

Every member's heartbeat ("alive", utils/elastic/detector.py) carries its progress, so any member
can answer for all. The asker is not a member: its sender is "status-<nonce>", the answer is
sealed for that name, and both carry the job's key (a wrong key gets no answer; the member counts
the datagram as it counts every bad one). No torch here: the asker answers at once.
"""

import json
import math
import os
import re
import socket
import time

from utils.elastic import key
from utils.elastic.checks import MAX_SECONDS, Rejected
from utils.elastic.wire import Ask, Envelope, Status
from utils.errors import UsageError
from utils.setup.handoff import Handoff

WINDOW = 20  # images per second and the step time: over this rank's last WINDOW steps
CANDIDATES = 64  # the asker tries the job's port + 0..63 (member r listens on port + r; utils/elastic/join.py)
ASK_SECONDS = 5.0
ASK_AGAIN = 0.25  # seconds between rounds of asks


class Record:
    """This rank's progress. stepped() runs on the training thread after every step (a few
    assignments, no system call); snapshot() on the heartbeat thread: each reads whole tuples,
    which the other replaces, never changes in place."""

    def __init__(self, epochs=0):
        self.epochs = epochs
        self.host, self.pid = socket.gethostname()[:255], os.getpid()
        # this server's restarts by its keeper (--restart) and comebacks after it lost the job (utils/elastic/rejoin.py)
        handoff = Handoff.from_environ()
        self.restarts, self.rejoins = handoff.restarts, handoff.rejoins
        self.last = (0, 0, 0, None, None)  # epoch, step, steps in the epoch, share, mean loss
        self.recent = ()  # (own images, seconds) of the last WINDOW steps

    def stepped(self, epoch, step, steps, own, size, seconds, mean_loss):
        """After `step` of `steps` in `epoch`: this rank took `own` of the step's `size` images in
        `seconds`; `mean_loss`: its mean loss over the epoch so far."""
        self.recent = (*self.recent[1 - WINDOW :], (own, seconds))
        self.last = (epoch, step, steps, own / size if size else None, mean_loss)

    def snapshot(self):
        """The record as checks.PROGRESS's fields, every value in its range (else None); None
        before this rank's first step."""
        (epoch, step, steps, share, loss), recent = self.last, self.recent
        if not recent:
            return None
        images, seconds = sum(i for i, _ in recent), sum(s for _, s in recent)
        per_step = seconds / len(recent) if recent else None
        left = None
        if per_step is not None:
            left = ((self.epochs - epoch) * steps + steps - step) * per_step
        return {
            "epoch": epoch,
            "epochs": self.epochs,
            "step": step,
            "steps": steps,
            "images_per_second": within(images / seconds if seconds > 0 else None, 1e12),
            "share": within(share, 1.0),
            "loss": within(loss, 1e30),
            "seconds_left": within(left, MAX_SECONDS),
            "host": self.host,
            "pid": self.pid,
            "restarts": self.restarts,
            "rejoins": self.rejoins,
        }


def within(value, high):
    return float(value) if value is not None and math.isfinite(value) and 0 <= value <= high else None


def answer(nonce, roster, heard, progress_of, now):
    """The Status a member sends for Ask `nonce`: every member of its roster (utils/elastic/roster.py)
    in rank order, with the seconds since this member heard it (None: itself; heard: id -> when), its
    host and pid, and its last progress (None: none yet; progress_of: id -> the last its beats carried)."""
    listing, me = [], roster.me
    for m in roster.members:
        progress, entry = progress_of.get(m), roster.book.get(m, {})
        listing.append(
            {
                "id": m,
                "heard": None if m == me else round(max(0.0, min(now - heard.get(m, now), MAX_SECONDS)), 3),
                "host": progress["host"] if progress else str(entry.get("host", ""))[:255],
                "pid": progress["pid"] if progress else entry.get("pid", 0),
                "progress": progress,
            }
        )
    return Status(nonce, roster.generation, roster.state.value, listing)


def ask(host, port, secret, seconds=ASK_SECONDS, more=()):
    """(address that answered, its job's token, its Status), from any member at `port` + 0..CANDIDATES-1
    of `host` or at an address of `more`, or None when none answered within `seconds` (no job there,
    or not the job's key)."""
    nonce = os.urandom(6).hex()
    envelope = Envelope(secret, f"status-{nonce}")
    candidates = [(host, port + i) for i in range(CANDIDATES) if port + i <= 65535]
    candidates += [a for a in more if a not in candidates]
    return exchange(
        envelope,
        lambda: envelope.seal(Ask(nonce)),
        candidates,
        lambda answer: type(answer) is Status and answer.nonce == nonce,
        time.monotonic() + seconds,
    )


def exchange(envelope, sealed, candidates, answers, deadline):
    """(address, job's token, message) of the first datagram sealed for `envelope`'s sender for which
    answers(message) holds, or None at `deadline` (time.monotonic()). Meanwhile every ASK_AGAIN s it
    sends sealed() to each address of `candidates`: sealed anew, as a member refuses a counter it has seen."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        while time.monotonic() < deadline:
            for candidate in candidates:
                try:
                    sock.sendto(sealed(), candidate)
                except OSError:
                    pass
            until = min(deadline, time.monotonic() + ASK_AGAIN)
            while (wait := until - time.monotonic()) > 0:
                sock.settimeout(wait)
                try:
                    datagram, source = sock.recvfrom(65536)
                    _, job, message = envelope.open(datagram)
                except (OSError, Rejected):  # a timeout, an ICMP error, or a datagram that is not its answer
                    continue
                if answers(message):
                    return source, job, message
    return None


def rows(status):
    """Every member of a Status as a flat dict (train.py --status --json's `members`)."""
    out = []
    for rank, m in enumerate(status.members):
        progress = m["progress"] or {}
        out.append(
            {
                "rank": rank,
                "id": m["id"],
                "host": m["host"],
                "pid": m["pid"],
                "epoch": progress.get("epoch"),
                "epochs": progress.get("epochs"),
                "step": progress.get("step"),
                "steps": progress.get("steps"),
                "images_per_second": progress.get("images_per_second"),
                "share": progress.get("share"),
                "heartbeat_seconds_ago": 0.0 if m["heard"] is None else m["heard"],
                "loss": progress.get("loss"),
                "seconds_left": progress.get("seconds_left"),
                "restarts": progress.get("restarts"),
                "rejoins": progress.get("rejoins"),
            }
        )
    return out


def summary(source, status):
    """train.py --status --json's object."""
    members = rows(status)
    answering = next(r["rank"] for r in members if status.members[r["rank"]]["heard"] is None)
    left = [r["seconds_left"] for r in members if r["seconds_left"] is not None]
    return {
        "generation": status.g,
        "state": status.state,
        "answered_by": {"rank": answering, "address": f"{source[0]}:{source[1]}"},
        "seconds_left": max(left) if left else None,
        "members": members,
    }


def table(job):
    """train.py --status's lines: a heading, then one row per member."""
    heading = (
        f"generation {job['generation']}, {job['state']}, {len(job['members'])} members (answered by rank "
        f"{job['answered_by']['rank']} at {job['answered_by']['address']}); time left {duration(job['seconds_left'])}"
    )
    columns = ("rank", "host", "pid", "epoch", "step", "images/s", "share", "heartbeat", "loss", "restarts", "rejoins")
    cells = [columns]
    for r in job["members"]:
        cells.append(
            (
                str(r["rank"]),
                r["host"],
                str(r["pid"]),
                "-" if r["epoch"] is None else f"{r['epoch']}/{r['epochs']}",
                "-" if r["step"] is None else f"{r['step']}/{r['steps']}",
                "-" if r["images_per_second"] is None else f"{r['images_per_second']:.0f}",
                "-" if r["share"] is None else f"{r['share']:.1%}",
                f"{r['heartbeat_seconds_ago']:.1f} s ago",
                "-" if r["loss"] is None else f"{r['loss']:.4f}",
                "-" if r["restarts"] is None else str(r["restarts"]),
                "-" if r["rejoins"] is None else str(r["rejoins"]),
            )
        )
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return [heading] + ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def duration(seconds):
    if seconds is None:
        return "unknown"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def command(where, init_method, key_file, checkpoint, as_json=False):
    """train.py --status [HOST:PORT] [--json]: print the job's table (or its JSON object). UsageError
    (one line, exit code 2) for a bad address, no key, or no member answering within ASK_SECONDS."""
    host, port = address_of(where, init_method)
    secret = key.for_joining(key_file, checkpoint)
    found = ask(host, port, secret)
    if found is None:
        raise UsageError(
            f"no job answered at {host}:{port} within {ASK_SECONDS:g} s with the key from "
            f"{key_source(key_file, checkpoint)} (wrong address or key, the job is over, or a firewall on its "
            "UDP ports)"
        )
    source, _, answer = found
    job = summary(source, answer)
    print(json.dumps(job) if as_json else "\n".join(table(job)), flush=True)


def address_of(where, init_method, mode="--status"):
    """(IPv4 address, port) of --status (or `mode`) HOST:PORT, or of --init-method tcp://HOST:PORT without it."""
    if not where:
        if not init_method or not init_method.startswith("tcp://"):
            raise UsageError(
                f"{mode} needs HOST:PORT of the job (its --init-method's) or --init-method tcp://HOST:PORT"
            )
        where, flag = init_method[len("tcp://") :], "--init-method"
    else:
        flag = mode
    match = re.fullmatch(r"(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})", where)
    if match is None or not 1 <= int(match.group(2)) <= 65535:
        raise UsageError(f"malformed {flag} {where!r}; expected HOST:PORT of the job, e.g. 192.168.0.1:23456")
    try:
        return socket.gethostbyname(match.group(1).strip("[]")), int(match.group(2))
    except (OSError, UnicodeError):
        raise UsageError(f"cannot resolve {match.group(1)} in {flag} {where!r} (IPv4 addresses only)") from None


def key_source(key_file, checkpoint, environ=os.environ):
    """Where key.for_joining found the key, in words."""
    if key_file:
        return f"--key-file {key_file}"
    if environ.get("RING_KEY_FILE"):
        return f"$RING_KEY_FILE {environ['RING_KEY_FILE']}"
    if environ.get("RING_JOB_KEY"):
        return "$RING_JOB_KEY"
    return key.copy_path(checkpoint)
