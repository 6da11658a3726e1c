"""The hierarchical ring (--allreduce hierarchical): several ranks per server, one network card.

A flat ring of N·k ranks (N hosts, k ranks each) pushes 2(Nk-1)/(Nk) of the buffer through
each host's card. Here a host's ranks first combine among themselves over loopback, so only
2(N-1)/N of the buffer per host crosses the cards. With k = 2 ranks on each of 2 hosts:

    1. reduce-scatter within each host (loopback), the ring of ring.py's first half:
           host A:  a0 ◀──▶ a1      afterwards a0 holds shard 0 summed over A, a1 shard 1
           host B:  b0 ◀──▶ b1      likewise for B
    2. one ring ACROSS hosts per shard, all at the same time (ring.ring_sum on the shard):
           a0 ◀── shard 0 ──▶ b0     over the cards: each of the k rings carries 1/k of the
           a1 ◀── shard 1 ──▶ b1     buffer, so every local rank works and none is a funnel
    3. all-gather within each host (loopback), ring.py's second half: every rank gets every
       shard.

The three phases are pipelined over pieces of about 512 KB (Hierarchy.sum_), so the loopback
legs of one piece run while the card carries another: on the emulated cluster, whose hosts share
two cores, the loopback legs alone cost 15% of the wire time with 4 ranks per host.

Each element is added in one fixed order (along the host's ring, then along the shard's ring
across hosts) and only copied after that, so every rank ends with the same bits. With one rank
per host there is one shard and one ring over all ranks in rank order: exactly `ring`.

Hosts with different numbers of ranks: the buffer is cut into K shards, K = the most ranks
any host has. A host with k < K ranks gives each of its ranks a contiguous block of about K/k
shards; that rank carries each of them in its shard's ring, one after another, in shard order
(in that order no ring can wait on another that is still waiting: no deadlock). The sum is
right for any grouping; only the speed depends on it. train.py says so once at start-up.

Which ranks share a host, found once at start-up by every rank (discover(), a collective):
ranks share a host when their keys are equal. The key is the hostname, the kernel's boot id,
the network namespace (the inode of /proc/self/ns/net) and the IPv4 address of the gloo card
(GLOO_SOCKET_IFNAME). The hostname alone does not do: scripts/cluster.py's emulated hosts are
network namespaces of one machine that share the hostname, and containers often share one
("localhost"). Ranks in one network namespace of one kernel reach each other over loopback,
whatever they are called. train.py --host-id ID, when given, replaces the key: ranks with the same
ID share a host. It is a knob for tests (fake hosts over loopback) and for setups the key gets
wrong; a wrong grouping costs speed, never correctness. Under srun, train.py hands discover()
Slurm's node, which Slurm knows better than any key (utils.setup.config.Job.host_id says which).

Process groups: a Hierarchy holds the subgroups of one sum: one per host with more than one
rank, one per cross-host ring. dist.new_group is a collective of all ranks, so every rank
creates every Hierarchy at the same point, in the same order (utils/sync/factory.py makes one per
gradient bucket, so buckets never share connections; utils.comm.allreduce.Hierarchical owns it).
"""

import os
import queue
import socket
import threading

import torch
import torch.distributed as dist

from utils.comm import ring
from utils.elastic.sockets import ipv4_of
from utils.exchange import all_gather_json

PIECE_BYTES = 512 * 1024  # pipelining: about this much of the buffer per piece
MAX_PIECES = 32


def host_key(host_id=None):
    """What makes this rank's host: `host_id` if given (--host-id, or Slurm's node), else hostname,
    boot id, netns, gloo card."""
    if host_id:
        return "host id " + host_id
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("-")
    try:
        parts.append(f"netns:{os.stat('/proc/self/ns/net').st_ino}")
    except OSError:
        parts.append("-")
    card = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    parts.append(f"{card}:{ipv4_of(card) or '-'}" if card else "-")
    return "/".join(parts)


def discover(host_id=None):
    """The hosts of the default group: lists of global ranks, each sorted, hosts ordered by their
    first rank (host_id: see host_key). A collective (all_gather_json): the run asks once per
    group and hands the answer to make_allreduce."""
    return hosts_of(all_gather_json(host_key(host_id)))


def hosts_of(keys):
    """[key of rank 0, key of rank 1, ...] -> hosts (lists of ranks), ordered by first rank."""
    hosts = {}
    for rank, key in enumerate(keys):
        hosts.setdefault(key, []).append(rank)
    return list(hosts.values())


def one_host(hosts):
    """Whether every rank is on one host, as `hosts` (discover's) says (None: not known, so not)."""
    return hosts is not None and len(hosts) == 1


def describe(hosts):
    """'2 hosts × 2 ranks', '1 host × 3 ranks', or for uneven hosts '3 hosts × 1-2 ranks (2+2+1)'."""
    sizes = [len(h) for h in hosts]
    plural = lambda count, word: f"{count} {word}{'' if count == 1 else 's'}"  # noqa: E731
    if len(set(sizes)) == 1:
        return f"{plural(len(hosts), 'host')} × {plural(sizes[0], 'rank')}"
    return f"{len(hosts)} hosts × {min(sizes)}-{max(sizes)} ranks ({'+'.join(map(str, sizes))})"


def uneven_note(hosts):
    """The start-up note for hosts with different numbers of ranks (None if they are even)."""
    sizes = [len(h) for h in hosts]
    if len(set(sizes)) == 1:
        return None
    return (
        f"hierarchical: the hosts hold different numbers of ranks ({'+'.join(map(str, sizes))}): the buffer "
        f"is cut into {max(sizes)} shards, and a rank of a smaller host carries several, one after another"
    )


def blocks(hosts):
    """For each host, each local rank's shards: range(first, end) of the K shards (K = most ranks)."""
    shards = max(len(h) for h in hosts)
    return [[range(j * shards // len(h), (j + 1) * shards // len(h)) for j in range(len(h))] for h in hosts], shards


def plan(hosts):
    """The cross-host rings: [(shard, member ranks)], member i being the rank of host i that
    carries that shard. (Two shards never have the same members: the host with the most ranks
    gives each shard to another rank.)"""
    per_host, shards = blocks(hosts)
    return [
        (s, [next(h[j] for j, block in enumerate(per_host[i]) if s in block) for i, h in enumerate(hosts)])
        for s in range(shards)
    ], shards


class Hierarchy:
    """The process groups of one hierarchical sum over `hosts` (default: discover()).

    A collective: every rank creates it at the same point (dist.new_group, in the same order).
    `hosts` may leave ranks out (tests check several topologies in one world): those create the
    groups too, but take no part in the sum."""

    def __init__(self, hosts=None, timeout=None):
        self.hosts = hosts if hosts is not None else discover()
        rank = dist.get_rank()
        self.host = next((h for h in self.hosts if rank in h), None)  # None: not in `hosts` (tests)
        self.local = self.gather = None  # this host's ranks, for phases 1 and 3 (None: alone on the host)
        for h in self.hosts:  # every rank creates every group, in the same order
            groups = (
                [dist.new_group(h, timeout=timeout, backend="gloo") for _ in range(2)] if len(h) > 1 else [None] * 2
            )
            if h is self.host:
                self.local, self.gather = groups
        per_host, self.shards = blocks(self.hosts)
        self.local_blocks = per_host[self.hosts.index(self.host)] if self.host else []  # each local rank's shards
        self.rings = []  # (shard, group) of each cross-host ring this rank is in
        for shard, members in plan(self.hosts)[0]:
            group = dist.new_group(members, timeout=timeout, backend="gloo") if len(members) > 1 else None
            if rank in members and group is not None:
                self.rings.append((shard, group))

    def sum_(self, flat, wire_dtype=None):
        """Sum `flat` over all ranks, in place: loopback reduce-scatter, cross-host rings, all-gather.

        wire_dtype goes to the rings across hosts only, where the bytes cost: they round each
        shard's sum once, the same on every rank of the ring, and the all-gather over loopback
        (in the buffer's own type) only copies it, so every rank still ends with the same bits.

        Pipelined: the buffer goes through the three phases in pieces of about PIECE_BYTES, each
        phase in its own thread with its own groups, so that while the card carries piece c, the
        host's ranks already reduce piece c+1 and gather piece c-1 over loopback:

            phase 1 (this thread):  rs0  rs1  rs2  ...
            phase 2 (a thread):          x0   x1   x2   ...      (across hosts: the card)
            phase 3 (a thread):               ag0  ag1  ag2 ...

        Every phase handles the pieces in order, and a piece's additions are those of the whole
        buffer's scheme, so every rank still ends with the same bits.
        """
        pieces = self._pieces(flat)
        if len(pieces) == 1:
            for phase in range(3):
                self._phase(phase, flat, wire_dtype)
            return flat
        handoff, errors = [queue.SimpleQueue(), queue.SimpleQueue()], []

        def run(phase):
            try:
                for piece in pieces if phase == 0 else iter(handoff[phase - 1].get, None):
                    self._phase(phase, piece, wire_dtype)
                    if phase < 2:
                        handoff[phase].put(piece)
            except Exception as e:  # a lost peer: stop, and stop the phases after this one
                errors.append(e)
            finally:
                if phase < 2:
                    handoff[phase].put(None)

        helpers = [threading.Thread(target=run, args=(phase,), daemon=True) for phase in (1, 2)]
        for helper in helpers:
            helper.start()
        run(0)
        for helper in helpers:
            helper.join()
        if errors:
            raise errors[0]
        return flat

    def _pieces(self, flat):
        """The pieces the pipeline streams: about PIECE_BYTES each, or one if there is nothing to
        overlap (one host, or one rank on every host: then the sum is only the ring across hosts,
        exactly `ring`)."""
        return torch.tensor_split(flat, self._piece_count(flat.numel(), flat.element_size()))

    def _piece_count(self, numel, element_size):
        """The same on every rank (their rings must match): from the topology and the size only."""
        if self.shards == 1 or len(self.hosts) == 1:
            return 1
        return max(1, min(MAX_PIECES, round(numel * element_size / PIECE_BYTES)))

    def _phase(self, phase, piece, wire_dtype):
        """Phase 0 (reduce-scatter over loopback), 1 (the rings across hosts) or 2 (all-gather) of `piece`."""
        edge, k = self._edges(piece.numel()), len(self.host)
        if phase == 1:
            for shard, group in self.rings:  # in shard order (see the module's docstring)
                ring.ring_sum(piece[edge[shard] : edge[shard + 1]], group, wire_dtype)
        elif k > 1:
            segments = self._local_segments(piece, edge)
            if phase == 0:
                ring.ring_steps(segments, self.local, 0, k - 1)
            else:
                ring.ring_steps(segments, self.gather, k - 1, 2 * (k - 1))

    def _edges(self, numel):
        """Shard s is flat[edge[s]:edge[s+1]]."""
        return [s * numel // self.shards for s in range(self.shards + 1)]

    def _local_segments(self, flat, edge):
        """The host ring's segments: local rank j's block of shards, rotated by one, since
        ring_steps leaves local rank j with segment j+1 of its list."""
        mine = [flat[edge[b.start] : edge[b.stop]] for b in self.local_blocks]
        return [mine[(i - 1) % len(mine)] for i in range(len(mine))]

    def bytes_sent(self, numel, element_size, wire_element_size):
        """How many bytes this rank sends in one sum of `numel` elements: over loopback (in the
        buffer's element size) and across hosts (in the wire's)."""
        count = self._piece_count(
            numel, element_size
        )  # as torch.tensor_split cuts: the first numel % count get one more
        sizes = [numel // count + (i < numel % count) for i in range(count)]
        return sum(self._piece_bytes(size, element_size, wire_element_size) for size in sizes)

    def _piece_bytes(self, numel, element_size, wire_element_size):
        edge, k, sent = self._edges(numel), len(self.host), 0
        if k > 1:
            sizes = [edge[b.stop] - edge[b.start] for b in self.local_blocks]
            j = self.host.index(dist.get_rank())
            sent += sum(sizes[(j - s - 1) % k] for s in range(2 * (k - 1))) * element_size
        for shard, group in self.rings:
            sent += ring.ring_bytes_sent(
                edge[shard + 1] - edge[shard], wire_element_size, dist.get_rank(group), dist.get_world_size(group)
            )
        return sent
