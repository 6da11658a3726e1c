"""train.py --stop: ask a running job to stop after its current step, as a SIGTERM to one of its ranks would.

    command(where, init_method, key_file, checkpoint)   one line on who took the stop; else UsageError (exit 2)

Two exchanges of control datagrams, both signed with the job's key (utils/elastic/wire.py), within 5 s:

    Ask  -> Status     to any member at the job's ports (--status's question, utils/elastic/status.py):
                       which member answers, and its job's token (in the answer's envelope)
    Stop -> Stopping   to that member alone: sealed for its id and carrying the token, so a Stop
                       captured and replayed to another member, or to a later run of the job (another
                       token), is refused, and within the run the counters refuse it

The member asks for the stop as a first SIGTERM to its rank would (utils/setup/stop.request, which
train.py hands to its membership): the request rides with the next gradient sum, every rank stops
after that step, rank 0 saves the checkpoint, and every rank exits 3 with the command that resumes
it. No torch here, nor anything else heavy.
"""

import os
import time

from utils.elastic import key, status
from utils.elastic.wire import Envelope, Stop, Stopping
from utils.errors import UsageError


def command(where, init_method, key_file, checkpoint):
    """train.py --stop [HOST:PORT]: ask the job to stop and print which member took it. UsageError
    (one line, exit code 2) for a bad address, no key, or no member taking it within ASK_SECONDS."""
    host, port = status.address_of(where, init_method, "--stop")
    secret = key.for_joining(key_file, checkpoint)
    deadline = time.monotonic() + status.ASK_SECONDS
    found = status.ask(host, port, secret, status.ASK_SECONDS)
    if found is None or not taken(secret, *found, deadline):
        raise UsageError(
            f"no job took the stop at {host}:{port} within {status.ASK_SECONDS:g} s with the key from "
            f"{status.key_source(key_file, checkpoint)} (wrong address or key, the job is over, or a firewall on "
            "its UDP ports)"
        )
    source, _, answer = found
    rank = next(r for r, m in enumerate(answer.members) if m["heard"] is None)
    print(
        f"rank {rank} of the job ({source[0]}:{source[1]}) took the stop: every rank stops after its current "
        "step, rank 0 saves the checkpoint, and each exits with code 3, printing the command that resumes the job",
        flush=True,
    )


def taken(secret, source, token, answer, deadline):
    """Whether the member at `source`, which gave `answer` for the job of `token`, acknowledged a
    Stop (a Stopping sealed for this stopper) before `deadline` (time.monotonic())."""
    nonce = os.urandom(6).hex()
    envelope = Envelope(secret, f"stop-{nonce}")
    member = next((m["id"] for m in answer.members if m["heard"] is None), None)  # (None: nobody takes it)
    found = status.exchange(
        envelope,
        lambda: envelope.seal(Stop(nonce), to=member, job=token),
        [source],
        lambda reply: type(reply) is Stopping and reply.nonce == nonce,
        deadline,
    )
    return found is not None
