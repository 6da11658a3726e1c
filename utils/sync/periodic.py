"""--sync-every H: each rank takes H steps on its own gradients, then the ranks average what those
steps changed (an outer step); that sum runs behind the next steps and is merged T steps later
(--merge-after T, 1 <= T <= H).

    round k, H inner steps (Adam, the one-cycle schedule), each rank on its own share of each
    step's images:
      at its end:       d_k = S - params        this rank's change since the round's start S
                        start summing d_k       (our own ring, in a thread); S = params: the rank
                                                goes on where it is, its own d_k standing in for the mean
      T steps later:    wait for D_k = mean d_k
                        A = outer(A, D_k)       the anchor: --outer average: A - D_k; nesterov: DiLoCo's SGD
                        params = A - (S - params), S = A: the mean replaces its own change; the T
                                                steps taken since stay on top

          rank r:     | H inner steps | T .. H        | T .. H        |
          outer sum:                  |== d_1 ==|     |== d_2 ==|
          anchor A:    A0                       A0-D_1          A0-D_1-D_2

So every round's mean change reaches the anchor exactly once, T steps late, and in the meantime
each rank goes on with its own change (the eager update of overlapped DiLoCo, Kale et al. 2025).
Why the eager merge, T steps late (the accuracy each choice cost: docs/gradient-sum.md): waiting
for the next round's end costs accuracy, and going on from the bare anchor more. The inner steps
wait for the wire only if T steps are shorter than the sum. The anchor is the same on every
rank after every outer step; the working parameters differ between syncs by design.

The flags ride in the outer sum as extra values: every rank learns of a signal at the same
merge step, and --balance of the speeds, so its shares are looked at once a round. Under
--balance each rank's change is weighed by its share of the round's images (begin). finish()
(before evaluating or saving) only waits for the sum in flight; its result is merged at its step
as always, so saving changes no bits, and a checkpoint holds every rank's own state
(state_dict()): a stop mid-round resumes bit for bit. flush(), at the end of training,
merges everything: the same parameters on every rank.
"""

import dataclasses
import time

import torch

from utils.comm.allreduce import beside
from utils.comm.names import DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM
from utils.errors import PeerError, first_line
from utils.sync.interface import GradientSync, wait_for, waited_since
from utils.timeline import OFF


class PeriodicSync(GradientSync):
    """The gradient sync (utils/sync/interface.py) for --sync-every H > 1: `every` is H, `outer`
    the outer step, `merge_after` T (None: H)."""

    def __init__(
        self,
        model,
        allreduce,
        compressor,
        optimizer,
        scheduler,
        every,
        outer="average",
        outer_lr=DEFAULT_OUTER_LR,
        outer_momentum=DEFAULT_OUTER_MOMENTUM,
        merge_after=None,
        timeline=OFF,
        weighted=False,
        broken=None,
    ):
        super().__init__(optimizer, scheduler, compressor, timeline)
        self.params = [p for p in model.parameters()]
        self.allreduce = allreduce  # compressor (--compress none, bf16 or fp16): how the change travels
        self.every, self.outer, self.outer_lr, self.outer_momentum = every, outer, outer_lr, outer_momentum
        self.merge_after = merge_after or every  # inner steps from a sum's start to its merge
        self.anchor = self._flat().clone()  # the outer steps so far: the same on every rank
        self.start = self.anchor.clone()  # where this rank's round began
        self.momentum = torch.zeros_like(self.anchor) if outer == "nesterov" else None
        self.inner = 0  # inner steps taken this round
        # --balance: the round's change weighs as many images as this rank's shares of its steps had (see begin)
        self.weighted, self.weights = weighted, 0.0  # weights: the sum of this round's steps' weights so far
        self.merged = False  # the last step merged a round's sum: the flags that came with it are new (set by step)
        self.pending = None  # the sum in flight: a utils.comm.allreduce.Work
        self.broken = broken  # the membership's Event of a broken group (utils/sync/interface.py), or None
        self.arrived = None  # its mean change, once waited for
        self.failed = None  # a lost peer, seen at a merge

    # -- the training loop's calls ---------------------------------------------------------------
    has_rank_state = True  # each rank's own optimizer and working parameters, mid-round

    def begin(self, weight=1.0, flags=None):
        """Each inner step is on this rank's own share alone; with --balance (weighted) the round's
        change is weighed by the mean of its steps' weights, so that the mean change counts every
        image of the round alike (a rank with a fifth of the images moves the mean a fifth, not a
        half). Without --balance the plain mean stays (its bits with it)."""
        super().begin(weight, flags)
        self.weights += weight

    def sum(self):
        self._raise_failure()  # nothing is summed per step

    def _raise_failure(self):
        if self.failed is not None:
            failed, self.failed = self.failed, None
            raise failed

    def step(self):
        super().step()
        self.inner += 1
        self.merged = False
        try:
            if self.inner == self.merge_after:
                self._merge()
                self.merged = True
            if self.inner == self.every:
                self._round_end()
        except PeerError as e:  # this step is done (its optimizer step is taken): the next one fails
            self.failed = e

    def flags(self):
        """The flags of the last sum, as every kind gives them; the speeds (--balance) only at the step
        whose merge brought them: one look at the shares per round, at new speeds (utils/balance/shares.py)."""
        flags = super().flags()
        return flags if self.merged else dataclasses.replace(flags, speeds=())

    def finish(self):
        """Before evaluating or saving: wait for the sum in flight, and keep its result for the step
        where it would have been merged anyway (so a save changes no bits)."""
        self._raise_failure()
        self._collect()

    def flush(self):
        """The end of training: every round's change applied, the same parameters on every rank."""
        self._raise_failure()
        self._merge()
        if self.inner:  # a round cut short: its change too (none after a round's end, nor a step of momentum)
            self._start(self._change(self._flat()))
            self._collect()
            self._apply(self.arrived)
        self.arrived, self.start, self.inner, self.weights = None, self.anchor.clone(), 0, 0.0
        self._set(self.anchor)

    # -- the outer step ---------------------------------------------------------------------------
    def _flat(self):
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _round_end(self):
        """Start summing this round's change; meanwhile the rank goes on from where it is (its own
        change stands in for the mean until that is merged)."""
        working = self._flat()
        self._start(self._change(working))  # (the last round's mean is merged by now: merge_after <= every)
        self.start = working
        self.inner, self.weights = 0, 0.0

    def _change(self, working):
        """This round's change, as summed: weighed by its steps' mean weight under --balance."""
        change = self.start - working
        return change.mul_(self.weights / self.inner) if self.weighted else change

    def _merge(self):
        """The last round's mean change replaces this rank's own: the anchor takes its outer step, and
        the working parameters keep the steps taken since the round's start on top of it."""
        self._collect()
        if self.arrived is None:  # (the first round: nothing was summed yet)
            return
        progress = self.start - self._flat()
        self._apply(self.arrived)
        self.arrived = None
        self.start = self.anchor.clone()
        self._set(self.anchor - progress)

    def _start(self, change):
        flags = self.own_flags
        buffer = torch.empty(change.numel() + len(flags))
        buffer[: change.numel()] = change
        buffer[change.numel() :] = torch.tensor(flags)

        def average():
            started = time.perf_counter()
            try:
                with self.timeline.span("outer-sum"):
                    # the mean change, float32 adds; the flags (extra values) are summed, not divided
                    return self.compressor.average_(buffer, 0, self.allreduce, extras=len(flags))
            finally:
                self.busy_seconds += time.perf_counter() - started

        self.pending = beside(average, "outer-sum")  # (a lost peer: the training thread hears of it at the wait)

    def _collect(self):
        """Wait for the sum in flight, if any: its mean change becomes self.arrived."""
        if self.pending is None:
            return
        started = time.perf_counter()
        with self.timeline.span("wait", bucket=0):
            wait_for(self.pending.done, self.broken)
        self.waited_seconds += waited_since(started)
        work, self.pending = self.pending, None
        try:
            mean, numel = work.wait(), self.anchor.numel()
        except Exception as e:
            raise PeerError(first_line(e)) from None
        self.flag_sums = mean[numel:].tolist()
        self.arrived = mean[:numel]

    def _apply(self, mean_change):
        """The outer step on the anchor: plain averaging, or SGD with Nesterov momentum on the
        mean change as the outer gradient (DiLoCo)."""
        if mean_change is None:
            return
        if self.outer == "average":
            self.anchor.sub_(mean_change)
        else:
            self.momentum.mul_(self.outer_momentum).add_(mean_change)
            self.anchor.sub_(mean_change.add(self.momentum, alpha=self.outer_momentum), alpha=self.outer_lr)

    def _set(self, flat):
        with torch.no_grad():
            for p, part in zip(self.params, torch.split(flat, [p.numel() for p in self.params])):
                p.copy_(part.view_as(p))

    # -- the rest of the interface ----------------------------------------------------------------
    def stats(self):
        return dict(
            busy_seconds=self.busy_seconds,
            waited_seconds=self.waited_seconds,
            bytes_sent=self.allreduce.bytes_sent,
            bytes_summed=self.allreduce.bytes_summed,
        )

    def state_dict(self):
        """This rank's own state, mid-round too (after finish(): nothing in flight): so that a resume
        on as many ranks goes on bit for bit. On another number every rank takes rank 0's."""
        return {
            "optimizer": self.base_optimizer.state_dict(),
            "momentum": self.momentum,
            "anchor": self.anchor,
            "start": self.start,
            "working": self._flat(),
            "inner": self.inner,
            "weights": self.weights,
            "arrived": self.arrived,
            "compressor": self.compressor.state_dict(),
        }

    def load_state_dict(self, state):
        self.base_optimizer.load_state_dict(state["optimizer"])
        if self.momentum is not None:
            self.momentum.copy_(state["momentum"])
        self.anchor, self.start = state["anchor"].clone(), state["start"].clone()
        self.inner, self.arrived = state["inner"], state["arrived"]  # (flag_sums stay empty: no signal yet)
        self.weights = state.get("weights", float(self.inner))  # (a checkpoint from before --balance weighed)
        self.compressor.load_state_dict(state["compressor"])
        self._set(state["working"])

    def note(self):
        return self.allreduce.note()

    def close(self):
        if self.pending is not None:
            self.pending.done.wait()
            self.pending = None

    def abandon(self):
        """After a lost peer: the parameters go back to the anchor (the last outer step, the same on
        every rank); the round's inner steps are lost with the sum in flight."""
        self.pending = self.arrived = self.failed = None
        self._set(self.anchor)
        self.start = self.anchor.clone()
        self.inner, self.weights = 0, 0.0
        return False
