"""Lazy update (--lazy-update): LazySync, an OverlappedSync whose buckets' optimizer updates are
each applied as the next forward needs it.

After backward the trainer does not wait at all. Each bucket's update is applied just before the
next forward first uses its parameters. The next step's forward starts with conv1, whose small
bucket is done first, while the big fc bucket is still on the wire:

    main thread:   backward ... | forward: [step conv*] conv1 conv2 [step fc*] fc1 fc2 | backward
    bucket 0:      sum fc* ..........................................|
    bucket 1:              sum conv* |

Adam's update of a parameter reads only that parameter's gradient and state, so updating bucket
by bucket, with the step's learning rate, gives exactly the parameters of one optimizer.step().
"""

import time

from utils.sync.buckets import OverlappedSync
from utils.sync.interface import waited_since


class LazySync(OverlappedSync):
    """Does not wait after backward; the next forward applies each bucket's update (LazyUpdate)."""

    def __init__(self, model, *parts, **named):
        super().__init__(model, *parts, **named)
        self.lazy = LazyUpdate(model, self.base_optimizer, self.scheduler, self)

    def sum(self):
        self.backward_done()

    def step(self):
        self.lazy.step()

    def flags(self):  # the flag's bucket: the next forward would wait for it first anyway
        self.lazy.apply(self.flag_bucket)
        return super().flags()

    def finish(self):
        self.lazy.finish()

    def seconds_waited(self):  # (the next forward waits for the buckets it updates)
        return self.waited_seconds + self.lazy.waited_seconds

    def stats(self):
        return dict(super().stats(), waited_seconds=self.seconds_waited())

    def close(self):
        self.lazy.close()
        super().close()

    def abandon(self):
        self.close()
        return self.lazy.undo()


class LazyUpdate:
    """Applies one training step's optimizer update bucket by bucket, as the next forward needs it.

    step() after backward only notes that an update is due. A forward pre-hook on each layer
    waits for that layer's bucket and updates it; a hook after the whole forward updates anything
    the forward did not use and advances the learning-rate schedule, so backward always starts
    from fully updated parameters. finish() applies whatever is due at once (before evaluating
    or saving).
    """

    def __init__(self, model, optimizer, scheduler, overlapped):
        self.optimizer, self.scheduler, self.overlapped = optimizer, scheduler, overlapped
        self.due = []  # bucket indices whose update is still to be applied
        self.due_step = None
        self.kept = []  # (param, its value, its optimizer state) before a partial update
        self.waited_seconds = 0.0  # time the training thread blocked on communication
        self.handles = [model.register_forward_hook(lambda *_: self.finish())]
        for module in model.modules():
            mine = sorted({overlapped.bucket_of[p] for p in module.parameters(recurse=False)})
            if mine:
                self.handles.append(
                    module.register_forward_pre_hook(lambda *_, buckets=tuple(mine): self._update(buckets))
                )

    def step(self):
        self.due = list(range(len(self.overlapped.buckets)))
        self.due_step = self.overlapped.timeline.current_step()  # the step these updates belong to, for the timeline

    def apply(self, bucket):
        """Wait for `bucket`'s sum and apply its update now rather than in the next forward."""
        self._update((bucket,))

    def _update(self, buckets):
        for i in buckets:
            if i in self.due:
                start = time.perf_counter()
                self.overlapped.wait_bucket(i)
                self.waited_seconds += waited_since(start)
                self.due.remove(i)
                if self.due:  # part of a step: what it changes is kept, in case the rest never comes
                    self.kept += [
                        (p, p.detach().clone(), keep_state(self.optimizer.state.get(p, {})))
                        for p in self.overlapped.buckets[i]
                    ]
                with self.overlapped.timeline.span("optimizer", bucket=i, step=self.due_step):
                    step_only(self.optimizer, self.overlapped.buckets[i])
                for p in self.overlapped.buckets[i]:
                    p.grad = None
                if not self.due:  # the whole step is applied: now the next learning rate
                    self.scheduler.step()
                    self.kept = []

    def finish(self):
        self._update(tuple(self.due))

    def undo(self):
        """After a lost peer: take back the part of a step applied so far (its other buckets'
        sums will never come). Returns True if a step was due, which then counts as not done."""
        for p, value, state in self.kept:
            p.data.copy_(value)
            self.optimizer.state[p] = state
        self.kept, due, self.due = [], bool(self.due), []
        return due

    def close(self):
        for handle in self.handles:
            handle.remove()


def keep_state(state):
    return {k: v.clone() if hasattr(v, "clone") else v for k, v in state.items()}


def step_only(optimizer, params):
    """optimizer.step() for `params` alone, with the optimizer's current settings.

    For optimizers whose update is per parameter (Adam, SGD), stepping a model in pieces gives
    bit for bit the same result as one step over all of it.
    """
    wanted = {id(p) for p in params}
    groups = optimizer.param_groups
    optimizer.param_groups = [dict(g, params=[p for p in g["params"] if id(p) in wanted]) for g in groups]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = groups
