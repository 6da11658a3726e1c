"""One rank of the hierarchical ring test: sums known inputs over several faked topologies.

argv: rank world_size port out topology [topology ...]. A topology is the host id of ranks
0, 1, ... ("0,0,1,1": ranks 0 and 1 share host 0, ranks 2 and 3 host 1); ranks beyond it sit
that one out, so one world of processes checks many topologies. The first topology covers the
world and is found the way train.py finds it: this rank's host id (its entry in that topology) handed
to discover(), whose hosts make_allreduce("hierarchical") sums over; it is also summed
with bfloat16 on the wire.
The others go to Hierarchy directly.
"""

import datetime
import sys

import torch
import torch.distributed as dist

from utils.comm import hierarchical, ring
from utils.comm.allreduce import make_allreduce


def inputs(rank, size):
    return torch.randn(size, generator=torch.Generator().manual_seed(1000 * rank + size))


def sizes(hosts):
    """1, 7, N-1, N+1, (shards x hosts)+1, 9973, 1_000_003 (N: ranks in the topology)."""
    n, shards = sum(len(h) for h in hosts), max(len(h) for h in hosts)
    return sorted({1, 7, max(1, n - 1), n + 1, shards * len(hosts) + 1, 9973, 1_000_003})


if __name__ == "__main__":
    rank, world_size, port, out, *topologies = sys.argv[1:]
    rank, world_size = int(rank), int(world_size)
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timeout
    )
    results = {}
    for i, topology in enumerate(topologies):
        hosts = hierarchical.hosts_of(topology.split(","))
        if i == 0:
            found = hierarchical.discover(topology.split(",")[rank])
            assert found == hosts, (found, hosts)
            allreduce = make_allreduce("hierarchical", hosts=found)  # the default group's timeout
        else:
            allreduce = make_allreduce("hierarchical", timeout=timeout, hosts=hosts)
        ring_group = None  # one rank per host: compare with `ring`
        if all(len(h) == 1 for h in hosts):  # (new_group: every rank, in the same order)
            ring_group = dist.new_group(list(range(len(hosts))), timeout=timeout)
        if rank >= len(topology.split(",")):
            continue
        for size in sizes(hosts):
            flat = inputs(rank, size)
            allreduce.sum_(flat)
            results[f"{topology}/{size}"] = flat
            if i == 0:  # compressed: bfloat16 across hosts
                flat = inputs(rank, size)
                results[f"{topology}/{size}/bf16"] = allreduce.sum_(flat, torch.bfloat16)
            if ring_group is not None:  # one rank per host: must be `ring`, bit for bit
                results[f"{topology}/{size}/ring"] = ring.ring_sum(inputs(rank, size), ring_group)
    torch.save(results, out)
    dist.destroy_process_group()
