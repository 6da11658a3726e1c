"""gloo's own ring schedule, issued from Python with torch.distributed send/recv (a benchmark candidate).

`python bench/allreduce/allreduce.py --candidate bench/allreduce/candidates/gloo_schedule.py ...` measures it beside
`ring` and `gloo`. It answers one question: when `ring` trails gloo's all_reduce by a fraction
of a percent at N = 2, is the schedule to blame, or driving the messages from Python?

The schedule follows gloo's ring (gloo/allreduce.cc), as far as the wire sees it:
  - the buffer is cut into segments of at most 1 MiB, at least 2 per rank, a multiple of N;
  - rank r sends to r-1 and receives from r+1;
  - reduce-scatter then all-gather, each keeping two segments in flight: post a receive and a
    send, and before posting the third, wait for (and add) the first;
  - all-gather receives are posted only once reduce-scatter is done.
"""

import torch
import torch.distributed as dist

MAX_SEGMENT_BYTES = 1 << 20


def ring_sum(flat, group=None):
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return flat
    count = max(-(-flat.numel() * flat.element_size() // MAX_SEGMENT_BYTES), 2 * n)
    count = -(-count // n) * n  # segments, a multiple of n
    per_rank = count // n
    length = -(-flat.numel() // count)

    def segment(i):
        i %= count
        return flat[i * length : (i + 1) * length]  # the last ones may be short or empty

    to, frm = (rank - 1) % n, (rank + 1) % n
    scratch = [torch.empty(length, dtype=flat.dtype), torch.empty(length, dtype=flat.dtype)]
    rounds = count - per_rank  # segments each rank sends per phase

    def phase(post, finish):
        """Post round i, then finish round i-2: two rounds in flight."""
        in_flight = {}
        for i in range(rounds + 2):
            if i >= 2:
                finish(i - 2, *in_flight.pop(i - 2))
            if i < rounds:
                in_flight[i] = post(i)

    def post_reduce(i):
        out, into = segment((rank + 1) * per_rank + i), segment((rank + 2) * per_rank + i)
        recv = dist.irecv(scratch[i % 2][: into.numel()], frm, group=group, tag=i) if into.numel() else None
        send = dist.isend(out, to, group=group, tag=i) if out.numel() else None
        return recv, send, into

    def finish_reduce(i, recv, send, into):
        if recv is not None:
            recv.wait()
            into.add_(scratch[i % 2][: into.numel()])
        if send is not None:
            send.wait()

    def post_gather(i):
        out, into = segment(rank * per_rank + i), segment((rank + 1) * per_rank + i)
        recv = dist.irecv(into, frm, group=group, tag=rounds + i) if into.numel() else None
        send = dist.isend(out, to, group=group, tag=rounds + i) if out.numel() else None
        return recv, send

    def finish_gather(i, recv, send):
        for work in (recv, send):
            if work is not None:
                work.wait()

    phase(post_reduce, finish_reduce)
    phase(post_gather, finish_gather)
    return flat
