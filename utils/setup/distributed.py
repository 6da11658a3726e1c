"""The process group and what the ranks settle through it before training.

init_distributed(job, seconds)       join the gloo group, bound to the job's card (after handshake)
handshake(store, rank, ws, seconds)  the same world size, torch and program on every rank, or exit 2
torchrun_attempt_store(...)          under torchrun's agent: one store prefix per attempt
agree(config, model)                 every rank trains the same thing (compared by name)
broadcast_parameters(model)          rank 0's parameters everywhere, then proved equal
check_identical_parameters(model)    the sha256 of every rank's parameters, compared
"""

import dataclasses
import datetime
import hashlib
import json
import os
import time
import urllib.parse

import torch.distributed as dist

from utils.errors import Outcome, PeerError, UsageError, first_line
from utils.exchange import all_gather_json
from utils.learn.model import load_parameter_vector, parameter_vector
from utils.setup.program import differences, identity

HANDSHAKE = "train.py/handshake"  # the store's keys of the start-up handshake
ACK_WAIT = 5.0  # seconds rank 0 stays, after a difference, for the other side to have read its key


def init_distributed(job, seconds, attempt_store=None):
    """Join the gloo process group of utils.setup.config.Job `job`, bound to its card, with a timeout of
    `seconds` for the rendezvous and every send/recv (under torchrun's agent store: through
    `attempt_store`)."""
    if job.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = job.ifname  # gloo reads it when the group starts
    where = (
        job.init_method
        if job.init_method != "env://"
        else f"tcp://{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    )
    timeout = datetime.timedelta(seconds=seconds)
    came = (
        f"not every rank joined at {where} within {seconds:g} s "
        f"(are all {job.world_size} started, with the same --init-method?)"
    )
    try:
        store = attempt_store if attempt_store is not None else rendezvous_store(job, timeout)
        handshake(store, job.rank, job.world_size, seconds, came)
        if attempt_store is None:  # as torch's init_method=... does: the group's keys under a prefix of their own
            store = dist.PrefixStore("default_pg", store)
        dist.init_process_group("gloo", store=store, rank=job.rank, world_size=job.world_size, timeout=timeout)
    except (RuntimeError, ValueError) as e:
        text = str(e)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise UsageError(f"port of {where} is already in use on this host; choose another port") from None
        if "connectFullMesh" in text:  # the rendezvous worked; gloo's own connections did not
            raise PeerError(
                f"joined at {where} but could not connect to every other rank "
                f"(a firewall on gloo's ports, or a peer that went away): {first_line(e)}",
                Outcome.NOTHING_TO_RESUME,
            ) from None
        if job.rank == 0 or "wait timeout" in text:  # we reached rank 0, but not everyone came
            raise PeerError(came, Outcome.NOTHING_TO_RESUME) from None
        raise UsageError(
            f"could not reach rank 0 at {where} within {seconds:g} s "
            f"(wrong address, rank 0 not running, or a firewall): {first_line(e)}"
        ) from None


def rendezvous_store(job, timeout):
    """The rendezvous TCPStore of tcp://HOST:PORT or env:// (MASTER_ADDR, MASTER_PORT), as torch's
    init_method would make it (rank 0 hosts it, unless torchrun's agent does), but without waiting
    for every rank to connect: the handshake says who came."""
    if job.init_method == "env://":
        if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
            raise ValueError("env:// rendezvous: environment variables MASTER_ADDR and MASTER_PORT expected")
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    else:
        url = urllib.parse.urlparse(job.init_method)
        host, port = url.hostname, url.port
    agent_serves = (  # torch's rendezvous: torchrun's agent hosts the store at its MASTER_ADDR:MASTER_PORT
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and os.environ.get("MASTER_ADDR") == host
        and os.environ.get("MASTER_PORT") == str(port)
    )
    return dist.TCPStore(
        host,
        port,
        is_master=job.rank == 0 and not agent_serves,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=True,
    )


def handshake(store, rank, world_size, seconds, came):
    """Before the group: every rank writes {world_size, torch, program} to the store; rank r reads
    rank 0's, rank 0 reads every other rank's as it comes. A difference is one UsageError line
    naming both sides, on both sides, as soon as both have spoken; `came` is the PeerError text for
    a rank that does not come within `seconds`.

        rank r:  handshake/rank-r = {...}    reads handshake/rank-0    handshake/rank-r/read = 1
                                             waits for every handshake/rank-*
        rank 0:  handshake/rank-0 = {...}    reads handshake/rank-1, -2, ... as they come

    Rank 0, which may host the store, stays until the other side has read its key (at most
    ACK_WAIT s) before it leaves with the error."""
    mine = {"world_size": world_size, **identity()}
    store.set(f"{HANDSHAKE}/rank-{rank}", json.dumps(mine))
    deadline = time.monotonic() + seconds
    if rank != 0:
        theirs = read_handshake(store, 0, deadline, came)
        store.set(f"{HANDSHAKE}/rank-{rank}/read", "1")
        difference = handshake_difference(theirs, mine, rank)
        if difference:
            raise UsageError(difference)
        for other in range(1, world_size):  # every rank came (or it is the same error on every rank)
            read_handshake(store, other, deadline, came)
        return
    waiting, heard = list(range(1, world_size)), []
    while waiting:
        for other in [r for r in waiting if store.check([f"{HANDSHAKE}/rank-{r}"])]:
            waiting.remove(other)
            heard.append(other)
            difference = handshake_difference(mine, read_handshake(store, other, deadline, came), other)
            if difference:
                acks = [f"{HANDSHAKE}/rank-{r}/read" for r in heard]
                stay = time.monotonic() + ACK_WAIT
                while not store.check(acks) and time.monotonic() < stay:
                    time.sleep(0.02)
                raise UsageError(difference)
        if waiting and time.monotonic() > deadline:
            raise PeerError(came, Outcome.NOTHING_TO_RESUME)
        time.sleep(0.02)


def read_handshake(store, rank, deadline, came):
    """Rank `rank`'s handshake (waiting for it until `deadline`), a dict; {} if it is not one."""
    key = f"{HANDSHAKE}/rank-{rank}"
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise PeerError(came, Outcome.NOTHING_TO_RESUME)
        time.sleep(0.02)
    try:
        theirs = json.loads(store.get(key).decode())
    except ValueError:
        return {}
    return theirs if isinstance(theirs, dict) else {}


def handshake_difference(first, other, rank):
    """The line that says how rank 0's handshake `first` and rank `rank`'s `other` differ, or None."""
    if first.get("world_size") != other.get("world_size"):
        return (
            f"ranks were started with different --world-size: rank 0 has {first.get('world_size')}, "
            f"rank {rank} has {other.get('world_size')}"
        )
    return differences(first, other, "rank 0", f"rank {rank}")


def torchrun_attempt_store(rank, world_size, timeout):
    """Under torchrun's agent store: (this attempt's own store, whether rank 0 ran before in this job).

    torchrun's agent keeps one store for the whole job, and torch's env:// does not separate the
    attempts in it, so after a restart the dead ranks' gloo addresses are still there: a restarted
    rank that reads one before its peer has overwritten it gets "connection refused". So each
    attempt joins under a prefix of its own, and the ranks of an attempt agree on it through the
    store, with rank 0 as the leader:

        rank 0:   train.py/leader = A                  (A: a fresh random id)
        rank r:   train.py/A/answer/rank-r = a_r       (a_r: rank r's own fresh id)
        rank 0:   train.py/A/go = a_1,a_2,...          (once every rank has answered)
        rank r:   goes ahead when its own a_r is in A's go list

    A dead attempt's ids stay in the store, but nobody alive answered them, so a rank that reads
    a stale leader id never finds itself in its go list; it keeps watching the leader key until
    the new rank 0 writes. Counting starts per rank would not do: a rank that dies before counting
    leaves the counts apart for good. Nor would TORCHELASTIC_RESTART_COUNT: with --rdzv-backend
    c10d, the agent whose workers were healthy restarts them without counting a restart.
    """
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        agent_store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
    except (RuntimeError, ValueError) as e:
        raise PeerError(
            f"could not reach torchrun's store at {where}: {first_line(e)}", Outcome.NOTHING_TO_RESUME
        ) from None
    try:
        return agree_on_attempt(agent_store, rank, world_size, timeout)
    except RuntimeError as e:  # the store went away: torchrun's agent is gone or restarting
        raise PeerError(f"lost torchrun's store at {where}: {first_line(e)}", Outcome.NOTHING_TO_RESUME) from None


def agree_on_attempt(agent_store, rank, world_size, timeout):
    """The leader protocol of torchrun_attempt_store."""
    mine = os.urandom(8).hex()
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        restarted = agent_store.add("train.py/starts/rank-0", 1) > 1
        agent_store.set("train.py/leader", mine)
        answers = [f"train.py/{mine}/answer/rank-{r}" for r in range(1, world_size)]
        while answers and not agent_store.check(answers):
            if time.monotonic() > deadline:
                raise PeerError(
                    f"not every rank of this torchrun attempt came within {timeout.total_seconds():g} s",
                    Outcome.NOTHING_TO_RESUME,
                )
            time.sleep(0.05)
        agent_store.set(f"train.py/{mine}/go", ",".join(v.decode() for v in agent_store.multi_get(answers)))
        return dist.PrefixStore(f"train.py/attempt-{mine}", agent_store), restarted
    answered = None
    while True:
        leader = agent_store.get("train.py/leader").decode() if agent_store.check(["train.py/leader"]) else None
        if leader is not None and leader != answered:
            agent_store.set(f"train.py/{leader}/answer/rank-{rank}", mine)
            answered = leader
        go = f"train.py/{answered}/go"
        if answered is not None and agent_store.check([go]) and mine in agent_store.get(go).decode().split(","):
            return dist.PrefixStore(f"train.py/attempt-{answered}", agent_store), False
        if time.monotonic() > deadline:
            raise PeerError(
                f"rank 0 of this torchrun attempt did not come within {timeout.total_seconds():g} s",
                Outcome.NOTHING_TO_RESUME,
            )
        time.sleep(0.05)


def agree(config, model):
    """Every rank must train the same thing: compare config.must_agree() (and the model), by name.
    Returns the config with rank 0's --timeline steps: every rank records, rank 0 writes."""
    mine = {"model": model_name(model), **config.must_agree()}
    everyone = all_gather_json([mine, config.outputs.timeline_steps])  # (JSON: the steps come back a list)
    for rank, (theirs, _) in enumerate(everyone):
        for name in mine:
            if theirs[name] != everyone[0][0][name]:
                raise UsageError(
                    f"ranks were started with different --{name}: rank 0 has {everyone[0][0][name]}, "
                    f"rank {rank} has {theirs[name]}"
                )
    steps = tuple(everyone[0][1]) if everyone[0][1] is not None else None
    return dataclasses.replace(config, outputs=dataclasses.replace(config.outputs, timeline_steps=steps))


def model_name(model):
    return f"{type(model).__name__}/{sum(p.numel() for p in model.parameters())}"


def broadcast_parameters(model):
    """Copy rank 0's parameters to every rank, then prove all ranks hold the same bits."""
    flat = parameter_vector(model)
    dist.broadcast(flat, src=0)
    load_parameter_vector(model, flat)
    check_identical_parameters(model)


def check_identical_parameters(model):
    """Compare a sha256 of every rank's parameters; returns it, or raises if any rank differs."""
    flat = parameter_vector(model)
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    digests = all_gather_json(digest)
    if len(set(digests)) != 1:
        raise PeerError(
            "parameters differ between ranks: " + ", ".join(f"rank {r} {d[:12]}" for r, d in enumerate(digests))
        )
    return digest
