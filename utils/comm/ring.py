"""Gradient sums over torch.distributed point-to-point messages (gloo).

Every function here takes ONE flat, contiguous tensor, the same size on every rank, and
replaces it in place with the element-wise sum over all ranks. Every rank ends with
bit-identical values: each element is added up in one place, in one order, and then only
copied. utils/comm/allreduce.py wraps each in an object (--allreduce picks one), which counts the
bytes and draws the timeline; utils/comm/hierarchical.py builds its sum from ring_steps.

    two_pass_ring_sum  the original protocol (default): a chain, then the total forwarded.
    ring_sum           bandwidth-optimal reduce-scatter + all-gather.
    ring_steps         any run of ring_sum's steps, over a group's ranks (the hierarchical sum).
    gloo_sum           dist.all_reduce, the reference.

wire_dtype: every function also takes the type its messages carry (None: the buffer's own). With
torch.bfloat16 or torch.float16 each hop carries 16-bit values, but a rank adds what it receives
to its own part in float32 and rounds once before passing the sum on, so the rounding error does
not compound along the ring. The finished sum is rounded once, and every rank keeps that rounded
value, so all ranks still end with the same bits. (gloo_sum cannot: gloo adds in the wire type.)

group: every function also takes a process group of ALL ranks, in the same order, that has its
own connections (utils/sync/buckets.py gives each gradient bucket one, so a small bucket need not
queue behind a big one on the same socket). Peer ranks are the same numbers as in the default
group. None means the default group.

Timeouts: gloo applies the process group's timeout (init_process_group(timeout=...)) to every
send and receive, so a silent peer turns into an exception instead of a hang.
"""

import math

import torch
import torch.distributed as dist

CHUNK_BYTES = 256 * 1024  # auto-pipelining: about this much per message
MAX_CHUNKS = 64


def auto_chunks(numel, element_size=4, one_host=False):
    """How many pieces the two-pass ring streams a buffer of `numel` elements in: pieces of about
    CHUNK_BYTES, so that a rank adds and sends on one while the next is on the wire; one piece when
    every rank is on one host, where a hop is a copy in memory and more pieces only add messages."""
    if one_host:
        return 1
    return max(1, min(MAX_CHUNKS, math.ceil(numel * element_size / CHUNK_BYTES)))


def resolve_chunks(chunks, numel, wire_dtype=None, one_host=False):
    """`chunks` as a number: "auto" counts the bytes on the wire (auto_chunks)."""
    if chunks != "auto":
        return chunks
    return auto_chunks(numel, torch.empty(0, dtype=wire_dtype or torch.float32).element_size(), one_host)


def two_pass_bytes_sent(numel, element_size, place, n):
    """How many bytes the rank at `place` in the chain sends in one two-pass sum of `numel`
    elements: the buffer once in pass 1, and once more in pass 2 at places 0..N-3."""
    if n == 1:
        return 0
    return numel * element_size * (2 if place < n - 2 else 1)


def ring_bytes_sent(numel, element_size, rank, n):
    """How many bytes `rank` sends in one ring_sum of `numel` elements: 2(N-1) segments of about 1/N."""
    if n == 1:
        return 0
    sizes = [len(s) for s in torch.tensor_split(torch.empty(numel, dtype=torch.uint8), n)]
    sent = sum(sizes[(rank - step) % n] for step in range(n - 1))  # reduce-scatter
    sent += sum(sizes[(rank + 1 - step) % n] for step in range(n - 1))  # all-gather
    return sent * element_size


def two_pass_ring_sum(flat, chunks=1, group=None, wire_dtype=None, first=0):
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

    first: the rank the chain starts at, the same on every rank: the drawings and the sum order then
    hold for places first, first+1, ... (mod N). The last place has the total first.
    """
    if dist.get_world_size(group) == 1:
        return flat
    chain = Chain(flat, chunks, group, wire_dtype, first)
    total = chain.head() if chain.place == 0 else chain.link()
    for work in chain.pending:
        work.wait()
    if total is not flat:
        flat.copy_(total)
    return flat


class Chain:
    """One two-pass sum in flight on this rank: its pieces (`own`, the buffer's K views), where the
    pass-1 sums arrive (`partials`), what it sends on (`outgoing`) and where the total lands
    (`totals`), and the sends not yet finished. Pass 1's messages are tagged c, pass 2's K + c.
    `place`: this rank's place in the chain (0: the head, at rank `first`); peers are named by place.

    On a float32 wire the sums are made, sent on and received in the buffer itself: own + partial
    is partial + own to the bit (IEEE addition commutes), and a piece's total can only arrive after
    this rank's send of that piece has been received down the chain, so it never lands in bytes
    still being sent. A 16-bit wire needs buffers of its own (the sums are rounded to it)."""

    def __init__(self, flat, chunks, group, wire_dtype, first=0):
        self.group, self.n, self.first = group, dist.get_world_size(group), first
        self.place = (dist.get_rank(group) - first) % self.n
        wire = wire_dtype or flat.dtype
        self.exact = wire == flat.dtype
        self.k = k = max(1, min(chunks, flat.numel()))
        self.own = torch.tensor_split(flat, k)
        if self.exact:
            self.total, self.outgoing, self.totals = flat, self.own, self.own
        else:
            self.total = torch.empty_like(flat, dtype=wire)  # the finished total
            self.rounded = torch.empty_like(self.total)  # pass-1 sums as sent on: rounded once
            self.outgoing, self.totals = torch.tensor_split(self.rounded, k), torch.tensor_split(self.total, k)
        # pass-1 sums arriving from the place before (the head receives none)
        self.partials = torch.tensor_split(torch.empty_like(flat, dtype=wire), k) if self.place else ()
        self.pending = []  # sends still in flight

    def send(self, piece, to, tag):
        """Send `piece` to the rank at place `to`."""
        self.pending.append(dist.isend(piece, (self.first + to) % self.n, group=self.group, tag=tag))

    def receive(self, pieces, sender, first_tag):
        """Post the receives of all K `pieces` from the rank at place `sender` at once."""
        sender = (self.first + sender) % self.n
        return [dist.irecv(pieces[c], sender, group=self.group, tag=first_tag + c) for c in range(self.k)]

    def head(self):
        """Place 0: send its pieces down the chain, receive the total from place N-1 and start pass 2."""
        k, last = self.k, self.n - 1
        receives = self.receive(self.totals, last, k)
        for c in range(k):
            self.send(self.own[c] if self.exact else self.outgoing[c].copy_(self.own[c]), 1, c)
        for c in range(k):
            receives[c].wait()
            if self.n > 2:  # pass 2 starts here
                self.send(self.totals[c], 1, k + c)
        return self.total

    def link(self):
        """Places 1..N-1: add its pieces to what arrives and send the sums on (place N-1: the total,
        back to place 0); then, but at place N-1, receive the total and forward it as far as place N-2."""
        k, n, place, last = self.k, self.n, self.place, self.n - 1
        receives = self.receive(self.partials, place - 1, 0)
        for c in range(k):
            receives[c].wait()
            summed = self.own[c].add_(self.partials[c])  # (a 16-bit wire: added in float32, rounded once)
            self.send(
                summed if self.exact else self.outgoing[c].copy_(summed), (place + 1) % n, c if place < last else k + c
            )
        if place == last:
            return self.total if self.exact else self.rounded  # pass 1 ended here with the total
        receives = self.receive(self.totals, place - 1, k)
        for c in range(k):
            receives[c].wait()
            if place < n - 2:  # pass 2 stops at place N-2
                self.send(self.totals[c], place + 1, k + c)
        return self.total


def ring_sum(flat, group=None, wire_dtype=None):
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
        ring_steps(torch.tensor_split(flat, n), group, 0, 2 * (n - 1), wire_dtype)
    return flat


def ring_steps(segments, group, first, last, wire_dtype=None):
    """Steps first..last-1 of the ring of ring_sum over `segments` (one view per rank of `group`).

    Steps 0..N-2 are the reduce-scatter, after which rank r holds segments[(r+1) % N] fully
    summed; steps N-1..2N-3 are the all-gather. Step s sends segments[(r-s) % N] to the right
    neighbour and receives segments[(r-s-1) % N] from the left (a partial sum lands in scratch
    and is added; a finished segment is copied). The segments may differ in size (even be
    empty: both ends know and skip the message). Peers are ranks of `group` (group_dst/src),
    so `group` may be a subgroup (utils/comm/hierarchical.py runs the two halves on a host's ranks).

    With a wire_dtype, partial sums are rounded once per hop (added in the buffer's type), and
    the all-gather starts by rounding this rank's finished segment, which it keeps as well: a
    reduce-scatter alone leaves the finished segment unrounded, the all-gather then rounds it.

    Receives are posted one step ahead (message tag = step). gloo's send is a rendezvous: it
    starts only once the receiver's "ready" notice has arrived, and that notice queues behind
    whatever the receiver is still sending on the same connection (with N=2 the neighbours
    are the same rank, so a late notice serialises the two directions: bench/allreduce/NOTES.md)
    and in the same NIC queue. Posted a step early, it is there before the neighbour needs it.
    """
    Ring(segments, group, wire_dtype).run(first, last)


class Ring:
    """ring_steps over one list of segments: the rounded copies for the wire, the scratch that
    partial sums land in, and the sends not yet finished."""

    def __init__(self, segments, group, wire_dtype):
        self.segments, self.group = segments, group
        self.n, self.rank = n, rank = dist.get_world_size(group), dist.get_rank(group)
        wire = wire_dtype or segments[0].dtype
        self.exact = exact = wire == segments[0].dtype
        self.sizes = sizes = [segment.numel() for segment in segments]
        # Rounded copies for the wire: one per segment, never reused while a send may still read it.
        # The all-gather passes finished (rounded) segments; afterwards every rank copies them back.
        self.outgoing = segments if exact else torch.empty(sum(sizes), dtype=wire).split(sizes)
        self.gathered = segments if exact else torch.empty(sum(sizes), dtype=wire).split(sizes)
        self.scratch = [torch.empty(max(sizes), dtype=wire) for _ in range(2)]  # reduce-scatter steps alternate
        self.right, self.left = (rank + 1) % n, (rank - 1) % n
        self.sends = []

    def run(self, first, last):
        """Steps first..last-1, each step's receive posted one step ahead."""
        n, rank = self.n, self.rank
        incoming = self.receive(first, last)
        self.send(first, (rank - first) % n)
        for step in range(first, last):
            upcoming = self.receive(step + 1, last)  # one step ahead
            index, buffer = self.landing(step)
            if incoming is not None:
                incoming.wait()
            if step < n - 1:
                self.segments[index].add_(buffer)  # own + partial from the left (in float32)
            if step + 1 < last:
                self.send(step + 1, index)  # pass it on
            incoming = upcoming
        for work in self.sends:
            work.wait()
        if not self.exact and last > n - 1:  # the all-gather ran: keep the rounded sums
            for segment, finished in zip(self.segments, self.gathered):
                segment.copy_(finished)

    def landing(self, step):
        """(segment index, buffer) for what arrives in `step`: partial sums go to scratch first."""
        index = (self.rank - step - 1) % self.n
        if step < self.n - 1:
            return index, self.scratch[step % 2][: self.sizes[index]]
        return index, self.gathered[index]

    def receive(self, step, last):
        """Post the receive of `step` (none past the last step, none of an empty segment: both ends skip it)."""
        buffer = self.landing(step)[1] if step < last else None
        if buffer is None or not buffer.numel():
            return None
        return dist.irecv(buffer, group=self.group, group_src=self.left, tag=step)

    def send(self, step, index):
        """Send segment `index` in `step`: a partial sum, a finished one (both rounded), or a gathered one."""
        n, exact = self.n, self.exact
        if step < n - 1:
            segment = self.outgoing[index] if exact else self.outgoing[index].copy_(self.segments[index])
        elif step == n - 1:  # this rank's finished segment; it keeps the rounded value too
            segment = self.gathered[index] if exact else self.gathered[index].copy_(self.segments[index])
        else:
            segment = self.gathered[index]
        if segment.numel():
            self.sends.append(dist.isend(segment, group=self.group, group_dst=self.right, tag=step))


def gloo_sum(flat, group=None, wire_dtype=None):
    """Sum `flat` over all ranks with gloo's own all_reduce (the reference).

    With a 16-bit wire_dtype gloo adds in 16 bits at every hop; its result is still the same on
    every rank."""
    if dist.get_world_size(group) > 1:
        if wire_dtype is None or wire_dtype == flat.dtype:
            dist.all_reduce(flat, group=group)
        else:
            narrow = flat.to(wire_dtype)
            dist.all_reduce(narrow, group=group)
            flat.copy_(narrow)
    return flat
