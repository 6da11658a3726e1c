"""Summing gradients while backward is still running.

backward() produces gradients from the last layer to the first. Instead of waiting for all of
them, the parameters are grouped into buckets in that order; as soon as a bucket's gradients
are all there, a communication thread averages that bucket over the ranks (with any algorithm
of utils/ring.py) while autograd keeps computing the earlier layers:

    main thread:  backward fc2 fc1 | conv2 ......... conv1 | wait() | optimizer.step()
    comm thread:                   | sum bucket 0 (fc*)    | sum bucket 1 (conv*)

Buckets are always summed in the same order (0, 1, 2, ...) on every rank, whatever order the
hooks fire in, so the ranks' messages always match up.
"""
import threading
import time

import torch

from utils import ring


def make_buckets(params, bucket_bytes):
    """Group `params` (in backward order) into consecutive buckets of about bucket_bytes."""
    buckets, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class OverlappedGradientSum:
    """After loss.backward(), wait() returns once every gradient holds its average over ranks."""

    def __init__(self, params, algorithm="two-pass", chunks="auto", bucket_bytes=1 << 20):
        self.algorithm, self.chunks = algorithm, chunks
        self.buckets = make_buckets(list(reversed(list(params))), bucket_bytes)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.missing = [len(b) for b in self.buckets]
        self.ready = [threading.Event() for _ in self.buckets]
        self.done, self.error = threading.Event(), None
        self.busy_seconds = 0.0  # time the comm thread spent summing, for bandwidth figures
        self.lock = threading.Lock()
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self.bucket_of]
        threading.Thread(target=self._communicate, name="gradient-sum", daemon=True).start()

    def _on_gradient(self, param):  # runs inside backward, once per parameter
        i = self.bucket_of[param]
        with self.lock:
            self.missing[i] -= 1
            if self.missing[i] == 0:
                self.ready[i].set()

    def _communicate(self):
        try:
            while True:
                for i, bucket in enumerate(self.buckets):
                    self.ready[i].wait()
                    self.ready[i].clear()
                    start = time.perf_counter()
                    flat = torch.cat([p.grad.reshape(-1) for p in bucket])
                    ring.average_(flat, self.algorithm, self.chunks)
                    offset = 0
                    for p in bucket:
                        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
                    self.busy_seconds += time.perf_counter() - start
                self.done.set()
        except Exception as e:  # a dead peer: hand the error to the training thread
            self.error = e
            self.done.set()

    def wait(self):
        """Call after loss.backward(): blocks until all buckets are summed; raises what comm raised."""
        with self.lock:  # backward is over: every hook that was going to run has run
            for i, bucket in enumerate(self.buckets):
                if self.missing[i] > 0:  # parameters that took no part count as zero gradients
                    for p in bucket:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                    self.ready[i].set()
                self.missing[i] = len(bucket)  # for the next step
        self.done.wait()
        self.done.clear()
        if self.error is not None:
            raise RuntimeError(str(self.error)) from self.error

    def close(self):
        for hook in self.hooks:
            hook.remove()
