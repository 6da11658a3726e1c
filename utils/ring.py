"""Gradient sums over torch.distributed point-to-point messages (gloo).

Every function here takes ONE flat, contiguous tensor, the same size on every rank, and
replaces it in place with the element-wise sum over all ranks. Every rank ends with
bit-identical values: each element is added up in one place, in one order, and then only
copied. `average_()` divides by the world size afterwards; that is what training calls.

    two_pass_ring_sum  the original protocol (default): a chain, then the total forwarded.
    ring_sum           bandwidth-optimal reduce-scatter + all-gather.
    gloo_sum           dist.all_reduce, the reference.
    hierarchical       several ranks per host: loopback within hosts, ring_sum across them
                       (utils/hierarchical.py).

group: every function also takes a process group of ALL ranks, in the same order, that has its
own connections (utils/overlap.py gives each gradient bucket one, so a small bucket need not
queue behind a big one on the same socket). Peer ranks are the same numbers as in the default
group. None means the default group. The hierarchical sum takes a utils.hierarchical.Hierarchy
(its subgroups) instead; None means one for the default group, made on its first call.

Timeouts: gloo applies the process group's timeout (init_process_group(timeout=...)) to every
send and receive, so a silent peer turns into an exception instead of a hang.
"""
import math

import torch
import torch.distributed as dist

CHUNK_BYTES = 256 * 1024  # auto-pipelining: about this much per message
MAX_CHUNKS = 64


def auto_chunks(numel, element_size=4):
    """How many pieces the two-pass ring streams a buffer of `numel` elements in."""
    return max(1, min(MAX_CHUNKS, math.ceil(numel * element_size / CHUNK_BYTES)))


def two_pass_ring_sum(flat, chunks=1, group=None):
    """Sum `flat` over all ranks with the two-pass chain, in place.

    Pass 1 (reduce along the chain; the last rank closes the loop to rank 0):

        rank 0 ──g0──▶ rank 1 ──g0+g1──▶ rank 2 ── ... ──▶ rank N-1
          ▲                                                  │
          └──────────────── total = g0+...+gN-1 ─────────────┘

    Pass 2 (rank 0 forwards the total down the chain; rank N-1 already has it):

        rank 0 ──total──▶ rank 1 ──total──▶ ... ──total──▶ rank N-2

    With chunks=K the buffer is cut into K pieces that stream through the same chain one
    after another: piece c takes exactly the route above, so rank r can add and forward
    piece c while piece c+1 is still arriving. Each message has its own tag
    (pass 1: c, pass 2: K + c). The sum order is the same for any K: g0 + g1 + ... + gN-1.
    """
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return flat
    k = max(1, min(chunks, flat.numel()))
    own = torch.tensor_split(flat, k)
    partial = torch.empty_like(flat)   # pass-1 sums arriving from rank-1
    total = torch.empty_like(flat)     # the finished total
    partials, totals = torch.tensor_split(partial, k), torch.tensor_split(total, k)
    last = n - 1
    pending = []                       # sends still in flight

    if rank == 0:
        receives = [dist.irecv(totals[c], last, group=group, tag=k + c) for c in range(k)]
        pending += [dist.isend(own[c], 1, group=group, tag=c) for c in range(k)]
        for c in range(k):
            receives[c].wait()
            if n > 2:                  # pass 2 starts here
                pending.append(dist.isend(totals[c], 1, group=group, tag=k + c))
    else:
        receives = [dist.irecv(partials[c], rank - 1, group=group, tag=c) for c in range(k)]
        for c in range(k):
            receives[c].wait()
            partials[c].add_(own[c])
            pending.append(dist.isend(partials[c], (rank + 1) % n, group=group, tag=c if rank < last else k + c))
        if rank == last:
            total = partial            # pass 1 ended here with the total
        else:
            receives = [dist.irecv(totals[c], rank - 1, group=group, tag=k + c) for c in range(k)]
            for c in range(k):
                receives[c].wait()
                if rank < n - 2:       # pass 2 stops at rank N-2
                    pending.append(dist.isend(totals[c], rank + 1, group=group, tag=k + c))
    for work in pending:
        work.wait()
    flat.copy_(total)
    return flat


def ring_sum(flat, group=None):
    """Sum `flat` over all ranks, in place: reduce-scatter, then all-gather.

    The buffer is cut into N segments. Every step, each rank sends one segment to its right
    neighbour and receives another from its left, both at once:

        reduce-scatter, N-1 steps: receive a partial sum, add own part, pass it on.
        After it, rank r holds segment r+1 fully summed.

          step 0:   r0 ─s0─▶ r1 ─s1─▶ r2 ─s2─▶ r0      (segment index = sender's rank - step)
          step 1:   r0 ─s2─▶ r1 ─s0─▶ r2 ─s1─▶ r0      (each now carries two ranks' sum)

        all-gather, N-1 steps: pass the finished segments round the same ring, copying.

    Each rank sends 2(N-1)/N of the buffer, the least any all-reduce can. Segment j is
    summed in one fixed order along the ring, so every rank ends with the same bits.
    """
    n = dist.get_world_size(group)
    if n > 1:
        ring_steps(torch.tensor_split(flat, n), group, 0, 2 * (n - 1))
    return flat


def ring_steps(segments, group, first, last):
    """Steps first..last-1 of the ring of ring_sum over `segments` (one view per rank of `group`).

    Steps 0..N-2 are the reduce-scatter, after which rank r holds segments[(r+1) % N] fully
    summed; steps N-1..2N-3 are the all-gather. Step s sends segments[(r-s) % N] to the right
    neighbour and receives segments[(r-s-1) % N] from the left (a partial sum lands in scratch
    and is added; a finished segment is copied). The segments may differ in size (even be
    empty: both ends know and skip the message). Peers are ranks of `group` (group_dst/src),
    so `group` may be a subgroup (utils/hierarchical.py runs the two halves on a host's ranks).

    Receives are posted one step ahead (message tag = step). gloo's send is a rendezvous: it
    starts only once the receiver's "ready" notice has arrived, and that notice queues behind
    whatever the receiver is still sending on the same connection (with N=2 the neighbours
    are the same rank, so a late notice serialises the two directions: 2x the time) and in
    the same NIC queue. Posted a step early, it is there before the neighbour needs it.
    """
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    biggest = max(segment.numel() for segment in segments)
    scratch = [torch.empty(biggest, dtype=segments[0].dtype) for _ in range(2)]   # reduce-scatter steps alternate
    right, left = (rank + 1) % n, (rank - 1) % n

    def landing(step):
        """(segment index, buffer) for what arrives in `step`: partial sums go to scratch first."""
        index = (rank - step - 1) % n
        if step < n - 1:
            return index, scratch[step % 2][: segments[index].numel()]
        return index, segments[index]

    def receive(step):
        buffer = landing(step)[1] if step < last else None
        return dist.irecv(buffer, group=group, group_src=left, tag=step) if buffer is not None and buffer.numel() else None

    sends = []

    def send(step, segment):
        if segment.numel():
            sends.append(dist.isend(segment, group=group, group_dst=right, tag=step))

    incoming = receive(first)
    send(first, segments[(rank - first) % n])
    for step in range(first, last):
        upcoming = receive(step + 1)                              # one step ahead
        index, buffer = landing(step)
        if incoming is not None:
            incoming.wait()
        if step < n - 1:
            segments[index].add_(buffer)                          # own + partial from the left
        if step + 1 < last:
            send(step + 1, segments[index])                       # pass it on
        incoming = upcoming
    for work in sends:
        work.wait()


def gloo_sum(flat, group=None):
    """Sum `flat` over all ranks with gloo's own all_reduce (the reference)."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    return flat


ALGORITHMS = ("two-pass", "ring", "gloo", "hierarchical")


def sum_(flat, algorithm="two-pass", chunks=1, group=None):
    """Sum `flat` over all ranks in place with the named algorithm (chunks: a number or "auto")."""
    if algorithm == "two-pass":
        return two_pass_ring_sum(flat, auto_chunks(flat.numel()) if chunks == "auto" else chunks, group)
    if algorithm == "ring":
        return ring_sum(flat, group)
    if algorithm == "gloo":
        return gloo_sum(flat, group)
    if algorithm == "hierarchical":
        from utils.hierarchical import hierarchical_sum   # it builds on this module
        return hierarchical_sum(flat, group)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")


def average_(flat, algorithm="two-pass", chunks=1, group=None):
    """Average `flat` over all ranks in place: the sum, divided by the world size."""
    sum_(flat, algorithm, chunks, group)
    return flat.div_(dist.get_world_size(None if algorithm == "hierarchical" else group))
