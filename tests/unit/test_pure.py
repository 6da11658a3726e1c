"""Pure functions: bytes on the wire, the hierarchical plan, the data order, buckets, compression helpers."""

import pytest
import torch

from utils.comm import compress, hierarchical, ring
from utils.learn import data, mnist
from utils.learn.model import Net
from utils.setup import values
from utils.sync.buckets import flat_buffer, make_buckets, set_gradients
from utils.sync.lazy import step_only


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_bytes_sent_per_algorithm(n):
    numel = 1000
    two_pass = [ring.two_pass_bytes_sent(numel, 4, r, n) for r in range(n)]
    assert two_pass == [8000] * max(0, n - 2) + [4000] * min(n, 2)  # pass 2 stops at rank N-2
    ring_bytes = [ring.ring_bytes_sent(numel, 4, r, n) for r in range(n)]
    assert sum(ring_bytes) == 2 * (n - 1) * numel * 4  # 2(N-1)/N of the buffer each
    assert max(ring_bytes) - min(ring_bytes) <= 2 * (n - 1) * 4
    assert ring.two_pass_bytes_sent(numel, 4, 0, 1) == ring.ring_bytes_sent(numel, 4, 0, 1) == 0


def test_chunks():
    assert ring.auto_chunks(10) == 1
    assert ring.auto_chunks(421_642) == 7  # 1.69 MB in pieces of about 256 KB
    assert ring.auto_chunks(10**9) == ring.MAX_CHUNKS
    assert ring.resolve_chunks("auto", 421_642, torch.bfloat16) == 4
    assert ring.resolve_chunks(3, 421_642) == 3


def test_hierarchical_plan_gives_every_shard_one_ring():
    hosts = hierarchical.hosts_of(["a", "a", "b", "b", "c"])
    assert hosts == [[0, 1], [2, 3], [4]]
    assert hierarchical.describe(hosts) == "3 hosts × 1-2 ranks (2+2+1)"
    assert hierarchical.describe([[0, 1], [2, 3]]) == "2 hosts × 2 ranks"
    rings, shards = hierarchical.plan(hosts)
    assert shards == 2 and rings == [(0, [0, 2, 4]), (1, [1, 3, 4])]
    assert hierarchical.uneven_note([[0], [1]]) is None and "2+2+1" in hierarchical.uneven_note(hosts)


@pytest.mark.parametrize("n, batch", [(1, 64), (2, 64), (3, 64), (4, 10), (5, 7)])
def test_each_step_trains_every_image_once_whatever_the_ranks(n, batch):
    images, epoch = 203, 2
    shares = [data.step_batches(images, epoch, r, n, 1, batch) for r in range(n)]
    steps = data.steps_per_epoch(images, batch)
    order = data.epoch_permutation(images, epoch, 1)
    for s in range(steps):
        together = torch.cat([shares[r][0][s] for r in range(n)])
        assert sorted(together.tolist()) == sorted(order[batch * s : batch * (s + 1)].tolist())
        assert all(shares[r][1][s] == len(together) for r in range(n))
        sizes = [len(shares[r][0][s]) for r in range(n)]
        assert max(sizes) - min(sizes) <= 1


def test_buckets_flat_buffers_and_gradients():
    model = Net()
    for p in model.parameters():
        p.grad = torch.full_like(p, 2.0)
    params = list(reversed(list(model.parameters())))
    buckets = make_buckets(params, 1 << 20)
    assert [p for b in buckets for p in b] == params and len(buckets) == 2
    flat, numel = flat_buffer(buckets[1], weight=0.5, flag=[1.0, 7.0])
    assert numel == sum(p.numel() for p in buckets[1]) and flat.numel() == numel + 2
    assert torch.all(flat[:numel] == 1.0) and flat[numel:].tolist() == [1.0, 7.0]  # the flags, unweighted
    set_gradients(buckets[1], flat[:numel])
    assert all(torch.all(p.grad == 1.0) and p.grad.data_ptr() >= flat.data_ptr() for p in buckets[1])


def test_an_optimizer_step_in_pieces_equals_one_step():
    torch.manual_seed(0)
    whole, pieces = Net(), Net()
    pieces.load_state_dict(whole.state_dict())
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (whole, pieces)]
    for _ in range(3):
        for m in (whole, pieces):
            for p in m.parameters():
                p.grad = torch.sin(p.detach() * 7 + 1)
        optimizers[0].step()
        params = list(pieces.parameters())
        step_only(optimizers[1], params[:3])
        step_only(optimizers[1], params[3:])
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), pieces.parameters()))


def test_compression_helpers():
    assert compress.power_of_two_below(1000.0) == 512.0 and compress.power_of_two_below(1e-50) == 2.0**-126
    p = compress.orthonormalize(torch.randn(50, 4, generator=torch.Generator().manual_seed(1)))
    assert torch.allclose(p.t() @ p, torch.eye(4), atol=1e-5)
    layout = compress.PowerSGD([[torch.empty(128, 3136), torch.empty(128)]], 4, 10).layouts[0]
    assert layout == ([(0, 128, 3136)], [(128 * 3136, 128)])  # the matrix compressed, the bias not
    states = [{"steps": [5], "errors": [torch.full((3,), float(r))], "qs": [None]} for r in range(3)]
    assert compress.state_for(states, 1, 3) is states[1]
    assert torch.equal(compress.state_for(states, 0, 2)["errors"][0], torch.full((3,), 1.0))  # the mean error


def test_timeline_steps_parse():
    assert values.parse_steps("21:60") == (21, 60)
    for bad in ("60:21", "0:3", "x", "5"):
        with pytest.raises(ValueError):
            values.parse_steps(bad)


def test_mnist_is_read_as_torchvision_reads_it():
    import os

    from conftest import REPO
    from torchvision.datasets import MNIST

    root = os.path.join(REPO, "data")
    mnist.ensure_mnist(root)
    raw = os.path.join(root, "MNIST", "raw")
    test = MNIST(root, train=False)
    assert torch.equal(data.read_idx(os.path.join(raw, "t10k-images-idx3-ubyte")), test.data)
    assert torch.equal(data.read_idx(os.path.join(raw, "t10k-labels-idx1-ubyte")).long(), test.targets)


def test_a_subset_is_the_first_images_of_the_whole_normalised_alike():
    import os

    from conftest import REPO

    root = os.path.join(REPO, "data")
    whole, part = data.load_mnist(root), data.load_mnist(root, 300, 20)
    for w, p, n in zip(whole, part, (300, 300, 20, 20)):
        assert torch.equal(w[:n], p) and len(p) == n
    raw = data.read_idx(os.path.join(root, "MNIST", "raw", "t10k-images-idx3-ubyte"))
    assert torch.equal(whole[2], ((raw.float() / 255.0 - data.MEAN) / data.STD).unsqueeze(1))  # the bits as ever
