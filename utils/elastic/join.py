"""Who is in the job: this rank's membership at start-up, or a new server joining a running job.

start_membership(config, model, instruments, request_stop)   every rank of a job that starts (a collective)
join_running_job(config, model, instruments, request_stop)   a server started with --join
report_dropped(membership)                                   at the end: the control datagrams it dropped

instruments: utils/observe/instruments.py's (OFF: none); bound to this rank's id once it is known.
request_stop(reason): what train.py --stop asks of this process (train.py hands in utils.setup.stop.request).
"""

import hashlib
import hmac
import os
import socket
import time

import torch.distributed as dist

from utils.elastic import key
from utils.elastic.membership import Membership
from utils.elastic.rejoin import keep_book, known_members, per_server
from utils.elastic.sockets import card_address
from utils.errors import Outcome, PeerError, UsageError, first_line
from utils.exchange import all_gather_json, broadcast_json
from utils.observe.instruments import OFF
from utils.setup.program import identity
from utils.store.outputs import job_pid


def start_membership(config, model, instruments=OFF, request_stop=None):
    """This rank's Membership, on the card gloo uses, signing with the job's key; the ranks' control
    addresses and the key are exchanged through the default group (a collective). model: its name."""
    job = config.job
    toward = (
        os.environ.get("MASTER_ADDR", "127.0.0.1")
        if job.init_method == "env://"
        else job.init_method[len("tcp://") :].rsplit(":", 1)[0]
    )
    port = (
        int(os.environ.get("MASTER_PORT", 0)) if job.init_method == "env://" else int(job.init_method.rsplit(":", 1)[1])
    )
    given = key.given(job.key_file)
    address = card_address(job.ifname, toward.strip("[]"))
    own_port = port + job.rank if port else 0
    membership = Membership(job.rank, job.heartbeat, address, given, own_port, instruments, request_stop)
    mine = {
        "entry": {"address": list(membership.address), "pid": job_pid(), "host": socket.gethostname()},
        "token": os.urandom(8).hex(),
        "key": fingerprint(given),
    }
    everyone = all_gather_json(mine)
    check_keys([e["key"] for e in everyone])
    if everyone[0]["key"] is None:  # nobody was given one: rank 0's new key, kept by every rank for a later --join
        membership.envelope.key = broadcast_json(key.new().decode() if job.rank == 0 else None, 0).encode()
        kept = key.keep(membership.envelope.key, config.outputs.checkpoint)
        if job.rank == 0 and kept:
            print(
                f"the job's key: {os.path.abspath(kept)} on every server "
                f"(a new server joins with --key-file and a copy of it)",
                flush=True,
            )
    membership.require({"model": model, **config.must_agree()}, identity())
    dist.barrier()  # the heartbeats start together: a rank still writing its key copy is not taken for silent
    membership.start({r: e["entry"] for r, e in enumerate(everyone)}, everyone[0]["token"])
    if per_server(job):  # the members' addresses, kept for the same command run again (utils/elastic/rejoin.py)
        membership.book_file = config.outputs.checkpoint
        keep_book(membership.book, config.outputs.checkpoint)
    instruments.bind(job.rank)
    return membership


def fingerprint(secret):
    """What ranks compare to see they hold the same key, without showing it."""
    return None if secret is None else hmac.new(secret, b"the job's key", hashlib.sha256).hexdigest()[:16]


def check_keys(fingerprints):
    """Every rank has rank 0's key, or none was given one; else one UsageError line, on every rank."""
    for rank, theirs in enumerate(fingerprints):
        if theirs == fingerprints[0]:
            continue
        if theirs and fingerprints[0]:
            why = f"rank {rank}'s key differs from rank 0's"
        else:
            has, lacks = (rank, 0) if theirs else (0, rank)
            why = f"rank {has} was given a key (--key-file, $RING_KEY_FILE or $RING_JOB_KEY) but rank {lacks} was not"
        raise UsageError(f"{why}; give every server the same key, or none")


def join_running_job(config, model, instruments=OFF, request_stop=None):
    """A server started with --join: ask a member of the running job to take it in, and join the
    group it decides (utils/elastic/membership.py). Returns (membership, decision). model: its name.
    It asks at --join's HOST:PORT (or --init-method's), and at every member this server knew."""
    job = config.job
    instruments.log(event="join-ready")  # torch and the data are loaded: what bench/recovery/recovery.py times from
    where = job.join or job.init_method[len("tcp://") :]
    host, port = where.rsplit(":", 1)
    if job.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = job.ifname
    own_port = int(job.init_method.rsplit(":", 1)[1]) + job.rank  # where members listen (free if it is back)
    secret = key.for_joining(job.key_file, config.outputs.checkpoint)
    address = card_address(job.ifname, host)
    membership = Membership(None, job.heartbeat, address, secret, own_port, instruments, request_stop)
    candidates = [(host, int(port) + i) for i in range(MAX_JOIN_CANDIDATES)]
    candidates += [a for a in known_members(config.outputs.checkpoint) if a not in candidates]
    for attempt in range(1, JOIN_ATTEMPTS + 1):
        try:
            decision = membership.request_join(
                candidates, {"model": model, **config.must_agree()}, identity(), job.rank, config.sync.timeout
            )
        except ValueError as e:
            raise UsageError(f"the job at {where} refused this server: {e}") from None
        except RuntimeError:
            raise UsageError(
                f"no running job answered at {where} within {config.sync.timeout:g} s (wrong address, the job "
                f"is over, a firewall on its UDP ports, or not the job's key: members drop what it does not sign)"
            ) from None
        try:
            membership.join(decision, timeout=job.heartbeat + 5, gloo_timeout=config.sync.timeout)
            break
        except (RuntimeError, ValueError) as e:  # a member was lost while it was taken in: the job forgot it, ask again
            if attempt == JOIN_ATTEMPTS:
                raise PeerError(
                    f"the job took this server in {attempt} times but its group never formed: {first_line(e)}",
                    Outcome.NOTHING_TO_RESUME,
                ) from None
    membership.require({"model": model, **config.must_agree()}, identity())
    membership.start_beating()
    membership.book_file = config.outputs.checkpoint
    keep_book(membership.book, config.outputs.checkpoint)
    instruments.bind(membership.me)
    return membership, decision


MAX_JOIN_CANDIDATES = 64  # a joining server asks the job's port + 0..63 (member r listens on port + r)
JOIN_ATTEMPTS = 3  # a join whose group did not form (a member lost meanwhile) is asked for again


def report_dropped(membership):
    """Bad traffic on the control ports (a --status with a wrong key among it) is dropped as it
    comes; each rank says how much at the end."""
    if membership is None:
        return
    line = membership.dropped()
    if line:
        print(line, flush=True)
    membership.instruments.log(event="control-plane", cpu=membership.cpu.seconds, process_cpu=time.process_time())
