"""Resuming on another number of ranks: the same global batch, data order, schedule and books.

Bits are not expected to survive a resize (the sums add in another order); the step after it must
match the unresized run's within float tolerance, and the job must end about as accurate.
"""

import os
import re
import signal

import procs
import pytest
import torch
from checkpoint_watch import Watch
from procs import checkpoint_position, final_digest, wait_for

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


STEPS = 10
# 1,000 test images, not 10,000 (evaluating those costs more than the 10 steps): the one step after the
# resize leaves the parameters within 1e-4, so both runs classify the same; 0.1 point is one image here
SMALL = [
    *("--train-subset", "640", "--test-subset", "1000", "--epochs", "1", "--metrics", ""),
    *("--save-every", str(STEPS - 1), "--timeout", "30"),
]


def parameters(path):
    return torch.cat([t.reshape(-1) for t in torch.load(path, weights_only=True).values()])


def accuracy(stdout):
    return float(re.search(r"test accuracy ([\d.]+)%", stdout).group(1))


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "before, after, extra",
    [(2, 3, ["--compress", "powersgd", "--powersgd-warmup", "2"]), (3, 2, ["--lazy-update"])],
    ids=["2-to-3-powersgd", "3-to-2-lazy"],
)
def test_the_step_after_a_resize_matches_the_unresized_run(before, after, extra, tmp_path):
    """The unresized run saves before its last step; that checkpoint resumes on another number of ranks
    for that one step. Its parameters must match the unresized run's end within float tolerance."""
    checkpoint, kept = tmp_path / "c.pt", tmp_path / "before-last-step.pt"
    ranks = procs.start_ranks(
        before, [*SMALL, *extra, "--checkpoint", str(checkpoint), "--save-path", str(tmp_path / "unresized.pth")]
    )
    try:  # the epoch's end (after evaluating) overwrites it: keep a copy first
        watch = Watch(checkpoint)
        wait_for(lambda: watch.keep_if_at((1, STEPS - 1), kept), 240, "the checkpoint before the last step")
        unresized = procs.wait_all(ranks, timeout=240)
    finally:
        for r in ranks:
            procs.kill_group(r)
    assert [code for code, _, _ in unresized] == [0] * before, [err for _, _, err in unresized]
    assert checkpoint_position(kept) == (1, STEPS - 1)

    ranks = procs.start_ranks(
        after, [*SMALL, *extra, "--checkpoint", str(kept), "--save-path", str(tmp_path / "resized.pth"), "--resume"]
    )
    resized = procs.wait_all(ranks, timeout=240)
    assert [code for code, _, _ in resized] == [0] * after, [err for _, _, err in resized]
    out = resized[0][1]
    assert (
        f"resuming from {kept}: epoch 1, after step {STEPS - 1}; resuming on {after} ranks; "
        f"the checkpoint was made on {before}"
    ) in out, out
    assert f"batch 64 ({'32' if after == 2 else '21-22'} per rank)" in out
    a, b = parameters(tmp_path / "unresized.pth"), parameters(tmp_path / "resized.pth")
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (a - b).abs().max()
    assert abs(accuracy(out) - accuracy(unresized[0][1])) <= 0.1


@pytest.mark.timeout(900)
def test_a_job_stopped_on_three_hosts_resumes_on_two(needs_root, tmp_path):
    """Emulated servers (scripts/cluster.py): SIGTERM to host 1's rank mid-epoch stops all three, saved;
    the job then goes on with hosts 0 and 1 alone, from the next image, and ends within 0.1 percentage
    point of a run that never stopped."""
    import cluster
    from hosts import NICS, report, start_ranks, wait_ranks

    settings = ["--train-subset", "3200", "--epochs", "1", "--metrics", "", "--save-every", "4", "--timeout", "30"]
    unresized = procs.wait_all(
        procs.start_ranks(
            3, [*settings, "--checkpoint", str(tmp_path / "u.pt"), "--save-path", str(tmp_path / "u.pth")]
        ),
        timeout=300,
    )
    assert [code for code, _, _ in unresized] == [0, 0, 0], [err for _, _, err in unresized]

    checkpoint = tmp_path / "c.pt"
    job = [*settings, "--checkpoint", str(checkpoint), "--save-path", str(tmp_path / "m.pth")]
    with cluster.Cluster(3, nics=NICS, starter=procs.popen) as c:
        (tmp_path / "three").mkdir()
        started = start_ranks(c, [c.train_argv(r, 29500, job) for r in range(3)], tmp_path / "three")
        wait_for(lambda: checkpoint.exists() or any(p.poll() is not None for p in started), 240, "training")
        os.killpg(started[1].pid, signal.SIGTERM)  # host 1's rank (its own session)
        results = wait_ranks(c, started, tmp_path / "three", timeout=60)
        assert [code for code, *_ in results] == [3, 3, 3], report(results)
        step = checkpoint_position(checkpoint)[1]
        assert all(f"stopped after epoch 1, step {step}/50 (SIGTERM to rank 1)" in err for _, _, err, _ in results)

        (tmp_path / "two").mkdir()
        argvs = [[*c.train_argv(r, 29501, job), "--resume"] for r in range(2)]
        for argv in argvs:
            argv[argv.index("--world-size") + 1] = "2"
        results = wait_ranks(c, start_ranks(c, argvs, tmp_path / "two"), tmp_path / "two", timeout=300)
    assert [code for code, *_ in results] == [0, 0], report(results)
    out = results[0][1]
    assert f"after step {step}; resuming on 2 ranks; the checkpoint was made on 3" in out, out
    assert "parameters identical on all 2 ranks" in out
    assert abs(accuracy(out) - accuracy(unresized[0][1])) <= 0.1, (out, unresized[0][1])
    assert final_digest(out) != final_digest(unresized[0][1])  # resized: the same run, not the same bits
