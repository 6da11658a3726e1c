"""utils/learn/optim.py beside torch.optim: the same parameters bit for bit, the same state dicts, each
one's checkpoint resumed by the other. (None of torch.compile's machinery imported, which a fresh
interpreter shows: tests/world/test_fresh_interpreter.py.)"""

import io

import pytest
import torch
import torch.nn.functional as F

from utils.learn.model import Net
from utils.learn.optim import Adam, OneCycleLR

STEPS = 20


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: two, on a machine whose cores other tests keep busy, wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pair(ours, lr=0.004, total_steps=STEPS):
    """A fresh model (the same every time) with ours or torch's Adam and one-cycle schedule."""
    torch.manual_seed(0)
    model = Net()
    if ours:
        optimizer = Adam(model.parameters(), lr=lr)
        scheduler = OneCycleLR(optimizer, max_lr=lr, total_steps=total_steps, pct_start=0.15)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total_steps, pct_start=0.15)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, steps, seed=1):
    data = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        images, labels = torch.randn(8, 1, 28, 28, generator=data), torch.randint(0, 10, (8,), generator=data)
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def same_parameters(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def same_optimizer_state(a, b):
    a, b = a.state_dict(), b.state_dict()
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(
        a["state"][i].keys() == b["state"][i].keys()
        and all(torch.equal(a["state"][i][k], b["state"][i][k]) for k in a["state"][i])
        for i in a["state"]
    )


def test_every_step_and_every_state_dict_is_torchs():
    theirs, ours = pair(ours=False), pair(ours=True)
    for _ in range(STEPS // 4):
        train(*theirs, 4)
        train(*ours, 4)
        assert same_parameters(theirs[0], ours[0])
        assert same_optimizer_state(theirs[1], ours[1])
        assert theirs[2].state_dict() == ours[2].state_dict()
        assert theirs[2].get_last_lr() == ours[2].get_last_lr()
    assert theirs[1].param_groups[0]["betas"][0] == ours[1].param_groups[0]["betas"][0] != 0.9  # beta1 cycled


def test_a_checkpoint_of_either_resumes_with_the_other_bit_for_bit():
    straight = pair(ours=True)
    train(*straight, STEPS)
    for first, second in [(False, True), (True, False)]:
        a = pair(ours=first)
        train(*a, 5)
        # the checkpoint as utils/store/checkpoint.py writes and reads it: torch.save, torch.load(weights_only=True)
        saved = {"model": a[0].state_dict(), "optimizer": a[1].state_dict(), "scheduler": a[2].state_dict()}
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        b = pair(ours=second)
        b[0].load_state_dict(loaded["model"])
        b[1].load_state_dict(loaded["optimizer"])
        b[2].load_state_dict(loaded["scheduler"])
        data_after_5 = 2  # the second part's data: any, as long as both sides see the same
        train(*b, STEPS - 5, seed=data_after_5)
        c = pair(ours=True)
        train(*c, 5)
        train(*c, STEPS - 5, seed=data_after_5)
        assert same_parameters(b[0], c[0]) and same_optimizer_state(b[1], c[1]), (first, second)


def test_moments_saved_in_the_old_layout_resume_bit_for_bit():
    """A checkpoint from before the convolutions' weights were channels_last holds their moments in
    the default layout; loaded into today's model they step exactly as moments saved in its own."""
    model, optimizer, scheduler = pair(ours=True)
    train(model, optimizer, scheduler, 5)
    state = optimizer.state_dict()
    assert any(not v.is_contiguous() for s in state["state"].values() for v in s.values())  # channels_last ones
    old = dict(state, state={i: {k: v.contiguous().clone() for k, v in s.items()} for i, s in state["state"].items()})
    twin = pair(ours=True)
    twin[0].load_state_dict(model.state_dict())
    twin[1].load_state_dict(old)
    twin[2].load_state_dict(scheduler.state_dict())
    train(model, optimizer, scheduler, STEPS - 5, seed=2)
    train(*twin, STEPS - 5, seed=2)
    assert same_parameters(model, twin[0]) and same_optimizer_state(optimizer, twin[1])


def test_a_step_of_some_parameters_leaves_the_others_alone():
    # utils/sync/lazy.py steps one bucket at a time by narrowing param_groups
    model, optimizer, scheduler = pair(ours=True)
    F.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.tensor([0, 1, 2, 3])).backward()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    groups = optimizer.param_groups
    optimizer.param_groups = [dict(groups[0], params=params[:2])]
    optimizer.step()
    optimizer.param_groups = groups
    assert [not torch.equal(p, q) for p, q in zip(params, before)] == [True, True] + [False] * (len(params) - 2)
    assert set(optimizer.state) == set(params[:2])
