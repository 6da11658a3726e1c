"""Compressed gradient sums: fewer bytes through the rings of utils/comm/ring.py on slow links.

A compressor averages one bucket's flat gradient over all ranks; it moves whatever it sends
through `sum_`, an all-reduce object of utils/comm/allreduce.py, so every --allreduce works:

    compressor.average_(flat, bucket, sum_, extras=0)    # in place; bucket: which one (its own state)

extras: the last `extras` values of `flat` are not gradients but small whole numbers that ride
along with the sum (utils/run.py's stop flag): they are summed exactly, never scaled, averaged or
compressed.

    none      sum_(flat), divide by N                                   4 bytes per value
    bf16      sum_(flat, wire_dtype=bfloat16): 16 bits a hop, float32 adds      2 bytes
    fp16      the same in float16, scaled by a power of two first, so that small gradients
              stay out of the subnormals and the largest partial sum stays below 65504
    powersgd  each weight matrix M (plus its error buffer) as P·Qᵀ of rank R:
                  P = M·Q         sum_(all P's of the bucket, and its uncompressed tensors)
                  P = orthonormal columns of P (the same bits on every rank)
                  Q = Mᵀ·P        sum_(all Q's)
                  update = P·Qᵀ/N;   error = M - update   (kept for the next step)
              R·(rows+cols) values instead of rows·cols (Vogels et al., NeurIPS 2019)

Every rank ends with bit-identical averages: what is summed comes out of the ring the same on
every rank, and whatever is computed from it (scales, P, P·Qᵀ) is computed the same way.
state_dict() is what a checkpoint needs to continue bit for bit; PowerSGD's error buffers are
this rank's own, so the trainer saves every rank's; state_for() says what a rank continues from
when the job resumes on another number of ranks.
"""

import math

import torch

from utils.comm.names import COMPRESSIONS, DEFAULT_POWERSGD_RANK, DEFAULT_POWERSGD_WARMUP  # noqa: F401 (read here)

FP16_MAX = 65504.0
FP16_HEADROOM = 16  # the last sum's largest value lands this far below FP16_MAX / N
MIN_COMPRESSION = 2  # PowerSGD compresses a matrix only if that saves at least half of it


def gradients_of(flat, extras):
    """The gradients in `flat`: all but its last `extras` values."""
    return flat[: flat.numel() - extras]


class NoCompression:
    """float32 on the wire: the plain average."""

    compresses = False  # True: each rank keeps a state of its own (fp16's scales, PowerSGD's error buffers)
    lost_rank_note = None  # what a job that loses a rank also loses, if anything

    def describe(self):
        """The start line's words for it ('' when nothing is compressed)."""
        return ""

    def average_(self, flat, bucket, sum_, extras=0):
        sum_(flat)
        gradients_of(flat, extras).div_(sum_.world_size)
        return flat

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class Bfloat16(NoCompression):
    """bfloat16 has float32's range: no scale needed."""

    compresses = True

    def describe(self):
        return "compress bf16"

    def average_(self, flat, bucket, sum_, extras=0):
        sum_(flat, torch.bfloat16)  # whole numbers up to 256 are exact in bfloat16
        gradients_of(flat, extras).div_(sum_.world_size)
        return flat


class Float16(NoCompression):
    """float16 on the wire, scaled by a power of two (exact in float32) chosen per bucket.

    The scale comes from the previous step's sum, which every rank holds bit for bit, so the
    ranks agree on it without a message. The first step, and a step whose sum overflowed (an inf
    in the result, seen alike by all ranks), ask for a safe scale instead: the sum over ranks of
    each rank's largest |value| bounds every partial sum (one extra tiny sum), and the bucket is
    summed again.
    """

    compresses = True

    def __init__(self):
        self.scales = {}  # bucket -> scale for its next sum

    def describe(self):
        return "compress fp16"

    def average_(self, flat, bucket, sum_, extras=0):
        n, scale = sum_.world_size, self.scales.get(bucket)
        values = gradients_of(flat, extras)  # the extras travel unscaled: whole numbers, exact in float16
        original = flat.clone() if scale is not None else None
        if scale is None:
            scale = self._safe_scale(values, sum_)
        values.mul_(scale)
        sum_(flat, torch.float16)
        if original is not None and not torch.isfinite(values).all():  # the scale was too bold
            flat.copy_(original)
            scale = self._safe_scale(values, sum_)
            values.mul_(scale)
            sum_(flat, torch.float16)
        largest = values.abs().max().item() / scale if values.numel() else 0.0
        if largest > 0 and math.isfinite(largest):
            self.scales[bucket] = power_of_two_below(FP16_MAX / (FP16_HEADROOM * n * largest))
        values.div_(scale * n)
        return flat

    @staticmethod
    def _safe_scale(flat, sum_):
        bound = torch.tensor([flat.abs().max().item() if flat.numel() else 0.0])
        sum_(bound)  # float32: the sum of every rank's largest value
        bound = bound.item()
        return power_of_two_below(FP16_MAX / bound / 2) if bound > 0 and math.isfinite(bound) else 1.0

    def state_dict(self):
        return {"scales": dict(self.scales)}

    def load_state_dict(self, state):
        self.scales = dict(state["scales"])


def power_of_two_below(x):
    """The largest power of two <= x (within float32's normal range), so scaling is exact."""
    return 2.0 ** max(-126, min(127, math.floor(math.log2(x))))


class PowerSGD(NoCompression):
    """Rank-R PowerSGD with error feedback and warm-started Q, per bucket.

    A Q (cols x R) is kept as the transpose of a row-major R x cols tensor, and the products are
    written with M's rows as the long side (P = (Qᵀ·Mᵀ)ᵀ, Qᵀ = Pᵀ·M): single-threaded BLAS is
    several times slower for M·Q and Mᵀ·P with R columns (bench/train_step/NOTES.md, "PowerSGD's
    matrix products, reordered").

    buckets: the parameters of each bucket, in the order of its flat buffer.
    warmup: steps summed uncompressed (and without error feedback) before compression starts.
    """

    compresses = True
    lost_rank_note = "the lost ranks’ PowerSGD error feedback is dropped"

    def __init__(self, buckets, rank, warmup, seed=0):
        self.rank, self.warmup, self.seed = rank, warmup, seed
        self.layouts = [self.layout([tuple(p.shape) for p in bucket]) for bucket in buckets]
        self.steps = [0] * len(buckets)  # sums done, per bucket
        self.errors = [None] * len(buckets)  # flat error buffer per bucket, once compressing
        self.qs = [None] * len(buckets)  # per bucket: list of Q (cols x R) per matrix

    def describe(self):
        return f"compress powersgd (rank {self.rank}, {self.warmup} warm-up steps)"

    def layout(self, shapes):
        """([(offset, rows, cols)] of the tensors worth compressing, [(offset, numel)] of the rest),
        for a bucket of tensors of these shapes."""
        matrices, plain, offset = [], [], 0
        for shape in shapes:
            numel = math.prod(shape)
            rows = shape[0] if len(shape) >= 2 else 0
            if rows and (rows + numel // rows) * self.rank * MIN_COMPRESSION < numel:
                matrices.append((offset, rows, numel // rows))
            else:
                plain.append((offset, numel))
            offset += numel
        return matrices, plain

    def average_(self, flat, bucket, sum_, extras=0):
        n, values = sum_.world_size, gradients_of(flat, extras)
        self.steps[bucket] += 1
        if self.steps[bucket] <= self.warmup:
            sum_(flat)
            values.div_(n)
            return flat
        matrices, plain = self.layouts[bucket]
        if self.errors[bucket] is None:
            self.errors[bucket] = torch.zeros_like(values)  # stays 0 where nothing is compressed
            self.qs[bucket] = self._initial_qs(bucket, matrices)
        error = self.errors[bucket]
        values.add_(error)  # M = gradient + what earlier steps left out
        ms = [flat[o : o + r * c].view(r, c) for o, r, c in matrices]
        # Phase 1: the uncompressed tensors, the extras and the P's, in one sum.
        counts = flat[values.numel() :]
        first = torch.cat(
            [flat[o : o + k] for o, k in plain]
            + [counts]
            + [(q.t() @ m.t()).t().reshape(-1) for m, q in zip(ms, self.qs[bucket])]
        )
        sum_(first)
        at = 0
        for o, k in plain:
            flat[o : o + k] = first[at : at + k].div_(n)
            at += k
        counts.copy_(first[at : at + extras])
        at += extras
        ps = []
        for m in ms:
            ps.append(orthonormalize(first[at : at + m.shape[0] * self.rank].view(m.shape[0], self.rank)))
            at += m.shape[0] * self.rank
        # Phase 2: the Q's, each as Qᵀ = Pᵀ·M (R x cols, row after row).
        second = torch.cat([(p.t() @ m).reshape(-1) for m, p in zip(ms, ps)]) if ms else torch.empty(0)
        sum_(second).div_(n)
        at, qs = 0, []
        for (offset, rows, cols), m, p in zip(matrices, ms, ps):
            q = second[at : at + cols * self.rank].view(self.rank, cols).clone().t()
            at += cols * self.rank
            approximation = p @ q.t()
            torch.sub(m, approximation, out=error[offset : offset + rows * cols].view(rows, cols))
            m.copy_(approximation)
            qs.append(q)
        self.qs[bucket] = qs  # the next step starts from these
        return flat

    def _initial_qs(self, bucket, matrices):
        """Random Q's, the same on every rank (seeded by the run's seed and the bucket)."""
        generator = torch.Generator().manual_seed(self.seed * 1000 + bucket)
        return [torch.randn(self.rank, cols, generator=generator).t() for _, _, cols in matrices]

    def state_dict(self):
        return {"steps": list(self.steps), "errors": list(self.errors), "qs": [list(q) if q else q for q in self.qs]}

    def load_state_dict(self, state):
        self.steps, self.errors = list(state["steps"]), list(state["errors"])
        self.qs = [list(q) if q else q for q in state["qs"]]


def state_for(states, rank, world_size):
    """What `rank` continues from, given every rank's compression state in a checkpoint.

    On as many ranks as the checkpoint was made on: its own. On another number: fp16's scales and
    PowerSGD's Q's and step counts are the same on every rank, so rank 0's serve everyone.
    PowerSGD's error buffers are each rank's own, and each update adds back their mean (the sum
    averages over the ranks): every new rank starts from the old ranks' mean error, so that mean,
    and with it what the coming updates owe, stays as it was.
    """
    if len(states) == world_size:
        return states[rank]
    state = dict(states[0])
    if "errors" in state:
        state["errors"] = [
            None if old is None else sum(s["errors"][b] for s in states) / len(states)
            for b, old in enumerate(state["errors"])
        ]
    return state


def orthonormalize(p):
    """Orthonormal columns by Gram-Schmidt, in place: a fixed order of float operations, so
    every rank, holding the same summed P, gets the same bits."""
    for i in range(p.shape[1]):
        column = p[:, i]
        for j in range(i):
            column.sub_(torch.dot(column, p[:, j]) * p[:, j])
        column.div_(column.norm().clamp_min(1e-8))
    return p


def make_compressor(
    name, buckets, powersgd_rank=DEFAULT_POWERSGD_RANK, powersgd_warmup=DEFAULT_POWERSGD_WARMUP, seed=0
):
    """The compressor for --compress `name`; buckets: the parameters of each bucket, in order."""
    if name == "none":
        return NoCompression()
    if name == "bf16":
        return Bfloat16()
    if name == "fp16":
        return Float16()
    if name == "powersgd":
        return PowerSGD(buckets, powersgd_rank, powersgd_warmup, seed)
    raise ValueError(f"unknown compression {name!r}; choose from {', '.join(COMPRESSIONS)}")
