"""Resuming on another number of ranks, the plan: every image of an epoch is trained once across a
resize, and PowerSGD's state carries over. (The runs themselves: tests/world/test_resize.py and
tests/cluster/test_resize_hosts.py.)"""

import torch

from utils.comm.compress import state_for
from utils.learn.data import epoch_permutation, step_batches


def test_every_image_of_an_epoch_is_trained_once_across_a_resize():
    """Steps cut the epoch's permutation by global position, so any number of ranks, and any switch
    between numbers at a step boundary, trains every image exactly once, G images a step."""
    for images, global_batch in ((1000, 64), (6400, 64), (70, 64), (103, 10)):
        permutation = epoch_permutation(images, 2, 7)
        steps = -(-images // global_batch)
        plan = {n: [step_batches(images, 2, r, n, 7, global_batch) for r in range(n)] for n in range(1, 6)}
        for n, ranks in plan.items():
            for batches, sizes in ranks:
                assert len(batches) == len(sizes) == steps
            for s in range(steps):
                shares = [len(batches[s]) for batches, _ in ranks]
                assert max(shares) - min(shares) <= 1 and sum(shares) == ranks[0][1][s]
                together = torch.cat([batches[s] for batches, _ in ranks])
                assert torch.equal(
                    together.sort().values, permutation[global_batch * s : global_batch * (s + 1)].sort().values
                )
            # rank r's batches are every n-th entry of the permutation, from r on
            for r, (batches, _) in enumerate(ranks):
                assert torch.equal(torch.cat(batches), permutation[r::n])
        for old, new, at in ((2, 3, min(5, steps)), (3, 2, 1), (4, 1, steps - 1), (1, 5, 0)):
            trained = [plan[old][r][0][s] for r in range(old) for s in range(at)] + [
                plan[new][r][0][s] for r in range(new) for s in range(at, steps)
            ]
            assert torch.equal(torch.cat(trained).sort().values, torch.arange(images))


def test_powersgd_state_on_another_number_of_ranks_keeps_the_mean_error():
    errors = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0])]
    q = [torch.ones(3, 2)]
    states = [{"steps": [12, 12], "errors": [e, None], "qs": [q, None]} for e in errors]
    assert state_for(states, 1, 2) is states[1]
    for rank in range(3):
        state = state_for(states, rank, 3)
        assert state["steps"] == [12, 12] and state["qs"] == [q, None] and state["errors"][1] is None
        assert torch.equal(state["errors"][0], torch.tensor([2.0, 0.0]))  # the old ranks' mean
    assert state_for([{"scales": {0: 2.0**-3}}] * 3, 1, 2) == {"scales": {0: 2.0**-3}}
