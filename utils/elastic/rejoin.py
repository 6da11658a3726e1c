"""The same command, run again, does the right thing: join the running job, resume it, or start it.

    how = choose(answered, checkpoint, resume)       JOIN, RESUME or START (pure)
    find_job(probe, rendezvous, deadline, clock)     the wait of a server that lost the job (pure)
    keep_book(book, checkpoint) / known_members(...) the members' control addresses, kept on disk

A server's training process that ended without the job (a crash, a cut cable whose side had no
majority, a freeze the job went on without) is started again by hand, by --restart, or by
systemd. It looks for the running job first: at --init-method and at every member it knew (the
book of members this server kept beside its checkpoint while it was in the job). A member that
answers takes it in at the job's next step (utils/elastic/growth.py). If no one answers, the job
as a whole has stopped, or never started: the ranks meet at --init-method as at any start, and
rank 0 resumes from its checkpoint if that is a run not yet finished with these settings.

A server that lost the job (Fenced, or no majority on its side) waits for it up to
--rejoin-timeout: it asks the members, and between asks it offers the rendezvous of a whole
restart (which forms only when every rank comes: a side without the majority never trains alone).
"""

import enum
import json
import os
import sys
import time

from utils.elastic import faults, key, status
from utils.errors import Outcome, PeerError, UsageError
from utils.store.files import special_kind, write_file

OUT_SINCE = "RING_OUT_SINCE"  # when this server left the job (time.time()): its heal line says how long it was out
REJOINS = "RING_REJOINS"  # how many times this server waited for its job to join it again
REJOIN_UNTIL = "RING_REJOIN_UNTIL"  # in the environment of a server that lost the job: when it stops waiting
LOCAL_RANK = "RING_LOCAL_RANK"  # in the environment of a rank the local launcher started (not a server's command)
ASK_SECONDS = 2.0  # how long a start waits for a member's answer: any member answers at once, even mid-recovery
RENDEZVOUS_SECONDS = 5.0  # a waiting server's offer of a whole restart, between two asks of the members


def per_server(job, environ=os.environ):
    """Whether this is a server's own command (--rank, --world-size, --init-method, given by hand,
    by --restart or systemd) of a job that takes servers back: not a rank of the local launcher,
    torchrun or Slurm (they start their ranks again themselves), not --no-recover."""
    return (
        job.rank is not None
        and job.world_size > 1
        and job.recover
        and not (job.torchrun or job.slurm or job.eval)
        and LOCAL_RANK not in environ
    )


class How(enum.Enum):
    JOIN = "join"  # a member answered: join the running job at its next step
    RESUME = "resume"  # nobody answered, and this run's checkpoint is a run not yet finished
    START = "start"  # nobody answered, and there is nothing to resume
    TRAINED = "trained"  # a server that waited for its job offered a whole restart, and the job ran in it


class Checkpoint(enum.Enum):
    """What rank 0 finds at --checkpoint, as choose() weighs it."""

    NONE = "none"
    UNFINISHED = "unfinished"  # of these settings, with epochs left
    FINISHED = "finished"
    OTHER = "other"  # another run's: other settings (it is set aside, as today)


def choose(answered, checkpoint, resume):
    """How this server starts. answered: a member of a running job took it in; checkpoint: what
    rank 0 finds (Checkpoint; the other ranks: NONE); resume: --resume was given."""
    if answered:
        return How.JOIN
    if checkpoint == Checkpoint.UNFINISHED or (resume and checkpoint == Checkpoint.FINISHED):
        return How.RESUME  # (a finished one: "nothing to do", as --resume says)
    return How.START


def look_for_job(config, offer):
    """Before a server's command starts its rank: How.JOIN if a member of its job answers, else
    How.START. A server that lost the job (REJOIN_UNTIL) waits for it (find_job; offer(): a whole
    restart, True when it formed and trained), and says in one line if it waited in vain."""
    waits_until = float(os.environ.get(REJOIN_UNTIL, "0"))
    more = known_members(config.outputs.checkpoint)
    if not waits_until:  # (a server that was in no job here, or whose job finished, asks nobody)
        return How.JOIN if more and job_answers(config, more) else How.START
    ask = lambda: logged("rejoin-ask", job_answers, config, more)  # noqa: E731
    how = find_job(ask, lambda: logged("rejoin-offer", offer), waits_until, time.time)
    if how is None:
        raise PeerError(
            f"waited {config.job.rejoin_timeout:g} s (--rejoin-timeout) for the job: no member answered, and not "
            "every rank came to start it again (the job is over, or this server is still cut off)",
            Outcome.GAVE_UP,
        )
    return how


def logged(event, call, *args):
    """call(*args), its outcome and seconds in RING_EVENTS (bench/heal/heal.py reads how a wait went)."""
    started = time.monotonic()
    outcome = call(*args)
    faults.log(event=event, outcome=bool(outcome), seconds=round(time.monotonic() - started, 3))
    return outcome


def job_answers(config, more):
    """Whether a member of this server's job answers (train.py --status's question, which any
    member answers at once), at --init-method or at `more`, the members this server knew."""
    host, port = config.job.init_method[len("tcp://") :].rsplit(":", 1)
    try:
        secret = key.for_joining(config.job.key_file, config.outputs.checkpoint)
    except UsageError:  # no key here: no job this server could join
        return False
    return status.ask(host.strip("[]"), int(port), secret, ASK_SECONDS, more) is not None


def find_job(ask_members, offer_rendezvous, deadline, clock):
    """A server that lost the job: ask the members (ask_members() -> True when taken in); no answer,
    offer the rendezvous of a whole restart (offer_rendezvous() -> True when the group formed and
    the job ran); again until clock() passes `deadline`. Returns How.JOIN or How.TRAINED; None: it
    waited in vain."""
    while True:
        if ask_members():
            return How.JOIN
        if clock() >= deadline:
            return None
        if offer_rendezvous():
            return How.TRAINED
        if clock() >= deadline:
            return None


def again(script, argv, seconds, environ=os.environ):
    """This process starts afresh as `script argv` (the same command; its stuck threads and broken
    group gone), waiting up to `seconds` for the job (train.py's train). Does not return."""
    rejoins = str(status.count(environ.get(REJOINS)) + 1)  # (shown by --status)
    env = dict(environ, **{REJOIN_UNTIL: repr(time.time() + seconds), OUT_SINCE: repr(time.time()), REJOINS: rejoins})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-u", os.path.abspath(script), *argv], env)


def absence(environ=os.environ):
    """What the joined line adds for a server that came back: '; back after 12.3 s out (restart 2)'."""
    try:
        since = float(environ.get(OUT_SINCE, ""))
    except ValueError:
        return ""
    restarts = environ.get("RING_RESTARTS")  # (utils/setup/keeper.py)
    return f"; back after {time.time() - since:.1f} s out" + (f" (restart {restarts})" if restarts else "")


def book_path(checkpoint):
    return checkpoint + ".members"


def keep_book(book, checkpoint):
    """This server's list of the members' control addresses ([host, port]), beside its checkpoint,
    for a later start of the same command. Nothing beside a device or FIFO checkpoint."""
    if special_kind(os.path.realpath(checkpoint)) is not None:
        return
    addresses = sorted({(str(e["address"][0]), int(e["address"][1])) for e in book.values()})
    write_file(book_path(checkpoint), (json.dumps([list(a) for a in addresses]) + "\n").encode(), private=True)


def known_members(checkpoint):
    """The addresses kept by keep_book, or [] (none, or a file that is not such a list)."""
    try:
        with open(book_path(checkpoint), "rb") as f:
            entries = json.loads(f.read(65536))
    except (OSError, ValueError):
        return []
    if not isinstance(entries, list):
        return []
    return [
        (host, port)
        for host, port in (e for e in entries if isinstance(e, list) and len(e) == 2)
        if isinstance(host, str) and len(host) < 256 and isinstance(port, int) and 0 < port < 65536
    ][:128]


def forget_book(checkpoint):
    """The job finished: a later run of the command starts afresh without asking anyone."""
    try:
        os.unlink(book_path(checkpoint))
    except OSError:
        pass
