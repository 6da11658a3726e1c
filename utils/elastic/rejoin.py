"""The same command, run again, does the right thing: join the running job, resume it, or start it.

    how = choose(answered, checkpoint, resume)       JOIN, RESUME or START (pure)
    job_answers(config, members)                     whether a member of this server's job answers
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
The states of that wait and who decides them: utils/setup/lifecycle.py.
"""

import enum
import json
import os
import time

from utils.elastic import key, status
from utils.errors import UsageError
from utils.setup.handoff import Handoff
from utils.store.files import special_kind, write_file

ASK_SECONDS = 2.0  # how long a start waits for a member's answer: any member answers at once, even mid-recovery


def per_server(job, handoff=None):
    """Whether this is a server's own command (--rank, --world-size, --init-method, given by hand,
    by --restart or systemd) of a job that takes servers back: not a rank of the local launcher,
    torchrun or Slurm (they start their ranks again themselves), not --no-recover. handoff: what
    this process was handed (utils/setup/handoff.py; None: this process's own)."""
    handoff = Handoff.from_environ() if handoff is None else handoff
    return (
        job.rank is not None
        and job.world_size > 1
        and job.recover
        and not (job.torchrun or job.slurm or job.eval)
        and not handoff.launched_locally
    )


class How(enum.Enum):
    JOIN = "join"  # a member answered: join the running job at its next step
    RESUME = "resume"  # nobody answered, and this run's checkpoint is a run not yet finished
    START = "start"  # nobody answered, and there is nothing to resume


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


def job_answers(config, more):
    """Whether a member of this server's job answers (train.py --status's question, which any
    member answers at once), at --init-method or at `more`, the members this server knew."""
    host, port = config.job.init_method[len("tcp://") :].rsplit(":", 1)
    try:
        secret = key.for_joining(config.job.key_file, config.outputs.checkpoint)
    except UsageError:  # no key here: no job this server could join
        return False
    return status.ask(host.strip("[]"), int(port), secret, ASK_SECONDS, more) is not None


def absence(handoff=None):
    """What the joined line adds for a server that came back: '; back after 12.3 s out (restart 2)'.
    handoff: what this process was handed (None: this process's own)."""
    handoff = Handoff.from_environ() if handoff is None else handoff
    if handoff.out_since is None:
        return ""
    restarts = f" (restart {handoff.restarts})" if handoff.restarts else ""  # (utils/setup/keeper.py)
    return f"; back after {time.time() - handoff.out_since:.1f} s out{restarts}"


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
