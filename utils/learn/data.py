"""MNIST as four in-memory tensors, and each rank's share of an epoch.

The files come from utils/learn/mnist.py (decompressed once, md5-checked) and are read here (read_idx:
a header, then the bytes; torchvision's reader gives the same tensors but costs every rank a
second of start-up to import).
"""

import math
import os

import torch

from utils.errors import UsageError
from utils.learn.mnist import ensure_mnist

MEAN, STD = 0.1307, 0.3081


def normalize(images_uint8):
    """uint8 images (N, 28, 28) -> float32 (N, 1, 28, 28), standardised like the MNIST example:
    (x / 255 - MEAN) / STD, in place on the one float copy (the same bits, a third of the passes)."""
    return images_uint8.float().div_(255.0).sub_(MEAN).div_(STD).unsqueeze(1)


def load_mnist(root="data", train_subset=None, test_subset=None):
    """Return (train_images, train_labels, test_images, test_labels) as tensors: the first
    train_subset / test_subset of each (None: all). Only those are normalised, which is most of
    a rank's start-up on a quick run."""
    ensure_mnist(root)
    raw = os.path.join(root, "MNIST", "raw")
    loaded = []
    for kind, first in (("train", train_subset), ("t10k", test_subset)):
        images = read_idx(os.path.join(raw, f"{kind}-images-idx3-ubyte"))[:first]
        loaded += [normalize(images), read_idx(os.path.join(raw, f"{kind}-labels-idx1-ubyte"))[:first].long()]
    return tuple(loaded)


def read_idx(path):
    """An IDX file of unsigned bytes as a uint8 tensor of its shape: a 4-byte magic number (0, 0,
    0x08 for unsigned bytes, the number of dimensions), each dimension as a big-endian 32-bit
    size, then the values in row-major order."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:3] != b"\x00\x00\x08":
        raise UsageError(f"{path} is not an IDX file of unsigned bytes")
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return torch.frombuffer(bytearray(data[4 + 4 * dims :]), dtype=torch.uint8).view(*shape)


def epoch_permutation(num_examples, epoch, seed):
    """The order of the training set in `epoch`: the same on every rank, whatever the number of ranks."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_examples, generator=generator)


def steps_per_epoch(num_examples, global_batch):
    return math.ceil(num_examples / global_batch)


def step_batches(num_examples, epoch, rank, world_size, seed, global_batch):
    """This rank's batch for every step of `epoch`, and how many images each step has in all.

    Step s trains on the permutation's entries G*s .. G*(s+1)-1 (G = global_batch; the last step
    on what is left), and rank r takes those at positions r, r+N, r+2N, ...: every N-th entry of
    the permutation, so the ranks' shares are disjoint and together cover the epoch once. Where G
    does not divide by N, the ranks' batches differ by one image (the extra one moves round the
    ranks from step to step). The steps do not depend on N, so a job resumed on another number of
    ranks goes on with the first image not yet trained on, and the learning-rate schedule holds.
    A rank gets no image only in a last step of fewer than N images; its gradient then weighs 0.

    Returns (batches, step_sizes): one index tensor and one image count per step.
    """
    mine = epoch_permutation(num_examples, epoch, seed)[rank::world_size]
    steps = steps_per_epoch(num_examples, global_batch)
    # this rank's entries before position p of the permutation: those at r + N*j < p
    before = [max(0, -(-(global_batch * s - rank) // world_size)) for s in range(steps + 1)]
    batches = [mine[before[s] : before[s + 1]] for s in range(steps)]
    return batches, [min(global_batch, num_examples - global_batch * s) for s in range(steps)]


class BalancedBatches:
    """step_batches' (batch, weight, images of the step in all) under --balance: step s's images
    are the same permutation entries G*s .. G*s+G-1, cut into consecutive shares by the shares of
    the moment (utils/balance/shares.py), which may change between two steps. A sequence of the epoch's
    steps, read one step at a time."""

    def __init__(self, num_examples, epoch, seed, global_batch, balance):
        self.order = epoch_permutation(num_examples, epoch, seed)
        self.num_examples, self.global_batch, self.balance = num_examples, global_batch, balance
        self.steps = steps_per_epoch(num_examples, global_batch)

    def __len__(self):
        return self.steps

    def __getitem__(self, index):
        first = self.global_batch * index
        size = min(self.global_batch, self.num_examples - first)
        shares, rank = self.balance.shares(size), self.balance.rank
        start = first + sum(shares[:rank])
        batch = self.order[start : start + shares[rank]]
        n = len(shares)
        return batch, 1.0 if len(batch) * n == size else len(batch) * n / size, size
