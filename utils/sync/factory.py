"""make_gradient_sync: the one place that turns the config's --allreduce, --overlap, --lazy-update,
--compress and --sync-every into a gradient sync (utils/sync/interface.py)."""

import datetime

from utils.comm.allreduce import make_allreduce
from utils.comm.compress import make_compressor
from utils.comm.hierarchical import one_host
from utils.errors import PeerError, first_line
from utils.sync.buckets import OverlappedSync, PlainSync, make_buckets
from utils.sync.lazy import LazySync
from utils.sync.periodic import PeriodicSync
from utils.timeline import OFF


def make_gradient_sync(model, sync, optimizer, scheduler, seed=0, hosts=None, timeline=OFF, broken=None):
    """The gradient sync of a utils.setup.config.Sync for `model` (a collective: every rank makes it
    at the same point, since it makes the buckets' process groups).

    hosts: the servers' ranks, for the hierarchical sum
    (utils.comm.hierarchical.discover; None: it asks); timeline: where the sync draws its spans;
    broken: the membership's Event of a broken group (utils/sync/interface.py), or None."""
    params = list(model.parameters())
    timeout = datetime.timedelta(seconds=sync.timeout)

    def allreduce(own_group):
        return make_allreduce(sync.allreduce, sync.chunks, timeout, own_group, hosts, timeline)

    if sync.sync_every > 1:  # H local steps, then the parameters' change (utils/sync/periodic.py)
        try:
            outer_sum = allreduce(own_group=True)
        except RuntimeError as e:
            raise PeerError(f"lost a peer during start-up: {first_line(e)}") from None
        outer = (sync.sync_every, sync.outer, sync.outer_lr, sync.outer_momentum, sync.merge_after)
        compressor = make_compressor(sync.compress, [params])
        weighted = sync.balance is not None  # (without --balance the plain mean: its bits stay)
        return PeriodicSync(model, outer_sum, compressor, optimizer, scheduler, *outer, timeline, weighted, broken)
    overlap = sync.overlap if sync.overlap is not None else overlap_by_default(sync, hosts)
    buckets = make_buckets(list(reversed(params)), int(sync.bucket_mb * 2**20)) if overlap else [params]
    compressor = make_compressor(sync.compress, buckets, sync.powersgd_rank, sync.powersgd_warmup, seed)
    try:
        first = allreduce(own_group=overlap)
        shared = first.native_async and not compressor.compresses  # see OverlappedSync
        allreduces = [first] + [first if shared else allreduce(own_group=True) for _ in buckets[1:]]
    except RuntimeError as e:
        raise PeerError(f"lost a peer during start-up: {first_line(e)}") from None
    parts = (buckets, allreduces, compressor, optimizer, scheduler, timeline)
    if not overlap:
        return PlainSync(*parts, broken=broken)
    return (LazySync if sync.lazy_update else OverlappedSync)(model, *parts, broken=broken)


def overlap_by_default(sync, hosts):
    """--overlap's default: on when the ranks span several hosts (hosts None: not known), where a sum
    spends time on the wire that backward can hide; off on one host, where a sum is CPU work that
    would only take turns with backward's on the same cores. A compressed or lazy sum overlaps
    wherever it runs: its buckets are part of its bits, and the lazy update is made of them. The
    default is the same on every rank (the hosts are every rank's same answer), and on one host,
    where it is off, the bits are those of --overlap (the same sums of the same values)."""
    return not one_host(hosts) or sync.compress != "none" or sync.lazy_update
