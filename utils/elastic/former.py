"""Forming a generation's process group: the members of a decision meet on the leader's store.

The group's store keys are named by the decision (its `name` prefix), so a group that did not
form leaves nothing that a later one could read.
"""

import datetime

import torch
import torch.distributed as dist


def form_group(decision, me, store, timeout, gloo_timeout):
    """Make the default process group that of `decision` (a wire.Decision) for member `me`.
    store: the leader's own TCPStore (None elsewhere: a client of decision.store). A RuntimeError
    if a member does not come within `timeout` seconds."""
    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError, AssertionError):
        pass
    if not dist.is_initialized():  # (after a failed init, torch's group counter stays up: it names the
        dist.distributed_c10d._world.group_count = 0  # store keys, which must match the other members')
    host, port = decision.store
    if store is None:
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(decision.name, store),
        rank=decision.members.index(me),
        world_size=len(decision.members),
        timeout=datetime.timedelta(seconds=timeout),
    )
    dist.barrier()
    dist.group.WORLD._get_backend(torch.device("cpu"))._set_default_timeout(datetime.timedelta(seconds=gloo_timeout))
