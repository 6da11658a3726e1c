"""Who is in the job: this rank's membership at start-up, or a new server joining a running job.

start_membership(job, settings)   every rank of a job that starts (a collective)
join_running_job(config, model)   a server started with --join
"""

import os
import socket

import torch.distributed as dist

from utils.elastic import faults
from utils.elastic.membership import Membership
from utils.elastic.sockets import card_address
from utils.errors import PeerError, UsageError, first_line
from utils.outputs import job_pid


def start_membership(job, settings):
    """This rank's Membership (utils.config.Job `job`), on the card gloo uses; the ranks' control
    addresses are exchanged through the default group (a collective). settings: what a joining
    server must have alike."""
    toward = (
        os.environ.get("MASTER_ADDR", "127.0.0.1")
        if job.init_method == "env://"
        else job.init_method[len("tcp://") :].rsplit(":", 1)[0]
    )
    port = (
        int(os.environ.get("MASTER_PORT", 0)) if job.init_method == "env://" else int(job.init_method.rsplit(":", 1)[1])
    )
    membership = Membership(
        job.rank, job.heartbeat, card_address(job.ifname, toward.strip("[]")), port + job.rank if port else 0
    )
    mine = {"address": membership.address, "pid": job_pid(), "host": socket.gethostname(), "token": os.urandom(8).hex()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    membership.settings = settings
    membership.start(dict(enumerate(everyone)), everyone[0]["token"])
    faults.setup(job.rank)
    return membership


def join_running_job(config, model):
    """A server started with --join: ask a member of the running job to take it in, and join the
    group it decides (utils/elastic/membership.py). Returns (membership, decision). model: its name."""
    job = config.job
    faults.log(event="join-ready")  # torch and the data are loaded: what bench/recovery.py times from
    where = job.join or job.init_method[len("tcp://") :]
    host, port = where.rsplit(":", 1)
    if job.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = job.ifname
    own_port = int(job.init_method.rsplit(":", 1)[1]) + job.rank  # where members listen (free if it is back)
    membership = Membership(None, job.heartbeat, card_address(job.ifname, host), own_port)
    for attempt in range(1, JOIN_ATTEMPTS + 1):
        try:
            decision = membership.request_join(
                [(host, int(port) + i) for i in range(MAX_JOIN_CANDIDATES)],
                {"model": model, **config.must_agree()},
                job.rank,
                config.sync.timeout,
            )
        except ValueError as e:
            raise UsageError(f"the job at {where} refused this server: {e}") from None
        except RuntimeError:
            raise UsageError(
                f"no running job answered at {where} within {config.sync.timeout:g} s "
                f"(wrong address, the job is over, or a firewall on its UDP ports)"
            ) from None
        try:
            membership.join(decision, timeout=job.heartbeat + 5, gloo_timeout=config.sync.timeout)
            break
        except (RuntimeError, ValueError) as e:  # a member was lost while it was taken in: the job forgot it, ask again
            if attempt == JOIN_ATTEMPTS:
                raise PeerError(
                    f"the job took this server in {attempt} times but its group never formed: {first_line(e)}",
                    resumable=False,
                ) from None
    membership.settings = {"model": model, **config.must_agree()}
    membership.start_beating()
    faults.setup(membership.me)
    return membership, decision


MAX_JOIN_CANDIDATES = 64  # a joining server asks the job's port + 0..63 (member r listens on port + r)
JOIN_ATTEMPTS = 3  # a join whose group did not form (a member lost meanwhile) is asked for again
