"""--sync-every 3 in a tiny gloo world (utils/sync/periodic.py): what one rank records (periodic(),
run by tests/support/world_worker.py and tests/support/ring_worker.py) and the float64 replay that checks it
(check_periodic(), by tests/world/test_tiny_world.py on 3 ranks and tests/world/test_ring.py on 1-5)."""

import torch

from utils.comm.allreduce import ALGORITHMS, make_allreduce
from utils.comm.compress import make_compressor
from utils.sync.flags import Flags
from utils.sync.periodic import PeriodicSync


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the parameters after its last step: the inner steps' end point, before the
    round's end moves them."""

    def step(self, closure=None):
        loss = super().step(closure)
        self.after = torch.cat([p.detach().reshape(-1) for g in self.param_groups for p in g["params"]])
        return loss


def periodic(rank, rounds=4, every=3, hosts=None):
    """--sync-every 3 on a tiny linear model, under every all-reduce and both outer steps, merging one
    step into the next round (and a round's end merge, and fp16, on the ring): at every step this
    rank's start point before it, its parameters after the optimizer and after the step, and the
    anchor; then 2 steps of a round cut short, and flush(); and once with --balance's weights. The
    test replays it in float64. hosts: the hierarchical sum's (None: found out)."""
    results = {}
    plan = [(name, outer, "none", 1, "") for name in ALGORITHMS for outer in ("average", "nesterov")]
    plan += [("ring", "average", "none", 3, ""), ("ring", "nesterov", "fp16", 2, "")]
    world_size = torch.distributed.get_world_size()
    for name, outer, wire, merge_after, weighted in plan + [("two-pass", "average", "none", 2, "/weighted")]:
        torch.manual_seed(1)
        model = torch.nn.Linear(5, 3)
        optimizer = RecordingSGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        sync = PeriodicSync(
            model,
            make_allreduce(name, chunks=3, own_group=True, hosts=hosts),
            make_compressor(wire, [list(model.parameters())]),
            optimizer,
            scheduler,
            every,
            outer,
            merge_after=merge_after,
            weighted=bool(weighted),
        )
        key = f"periodic/{name}/{outer}/{wire}/{merge_after}{weighted}"
        results[f"{key}/initial"] = sync.anchor.clone()
        record = {"start": [], "after": [], "params": [], "anchor": [], "weight": [], "speeds": []}
        record |= {"started": [], "waited": []}  # a sum started at the step; the training thread's waits so far
        in_flight = None
        for step in range(1, rounds * every + 3):
            # --balance's weights (N times this rank's share of the step): unequal on odd steps
            weight = 2 * (rank + 1) / (world_size + 1) if weighted and step % 2 else 1.0
            sync.begin(weight, Flags(speeds=(rank + 1,)))  # (--balance's codes: they arrive with a merge)
            record["weight"].append(torch.tensor(weight))
            images = torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank))
            model(images).square().mean().backward()
            record["start"].append(sync.start.clone())
            sync.sum()
            sync.step()  # (what the loop's DistributedOptimizer.step() takes)
            record["after"].append(optimizer.after)
            record["params"].append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
            record["anchor"].append(sync.anchor.clone())
            record["speeds"].append(torch.tensor(sum(sync.flags().speeds, start=-1)))  # -1: none this step
            record["started"].append(torch.tensor(sync.pending is not None and sync.pending is not in_flight))
            record["waited"].append(torch.tensor(sync.waited_seconds, dtype=torch.float64))
            in_flight = sync.pending
        results[f"{key}/cut-short"] = sync.start - record["params"][-1]  # the last round's steps so far
        sync.flush()
        results.update({f"{key}/{what}": torch.stack(values) for what, values in record.items()})
        results[f"{key}/final"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        sync.close()
    return results


def outer_step(anchor, momentum, mean_change, outer):
    """The outer step in float64, by the formulas: averaging, or DiLoCo's SGD with Nesterov momentum
    (lr 0.7, momentum 0.9)."""
    if outer == "average":
        return anchor - mean_change, momentum
    momentum = 0.9 * momentum + mean_change
    return anchor - 0.7 * (mean_change + 0.9 * momentum), momentum


def round_weight(r, key, t, steps):
    """Rank r's weight of its round of `steps` that ended with step t, in float64: the mean of the
    steps' weights under --balance (keys ending /weighted), else 1."""
    return r[f"{key}/weight"][t + 1 - steps : t + 1].double().mean() if key.endswith("/weighted") else 1.0


def round_change(r, key, t, every):
    """Rank r's change over its round that ended with step t, as summed: its start point minus where
    its optimizer left it, weighed."""
    return round_weight(r, key, t, every) * (r[f"{key}/start"][t] - r[f"{key}/after"][t]).double()


def check_periodic(results, every=3):
    """Every round's mean change reaches the anchor once, at the merge step of the next round (a
    float64 replay of what the ranks recorded); the anchor is bit-identical on every rank at every
    step; a merge swaps a rank's own change for the mean and keeps its steps since; no other step
    moves the parameters but the optimizer; flush() leaves one model on all ranks."""
    keys = sorted({k.rsplit("/", 1)[0] for k in results[0] if k.startswith("periodic/")})
    assert len(keys) == 11, keys
    for key in keys:
        outer, merge_after = key.split("/")[2], int(key.split("/")[4])
        tolerance = 1e-3 if "/fp16/" in key else 1e-6
        for what in ("anchor", "final", "initial"):
            assert all(torch.equal(r[f"{key}/{what}"], results[0][f"{key}/{what}"]) for r in results), (key, what)
        # each round's change on each rank: its start point minus where its optimizer left it at the round's end
        ends = [t for t in range(len(results[0][f"{key}/after"])) if (t + 1) % every == 0]
        means = torch.stack([torch.stack([round_change(r, key, t, every) for t in ends]) for r in results]).mean(0)
        assert means.abs().max() > 1e-3, key  # the rounds moved the parameters: the checks below bite
        anchor, momentum, merged = results[0][f"{key}/initial"].double(), 0.0, 0
        for t in range(len(results[0][f"{key}/after"])):
            inner, round_ = t % every + 1, t // every
            if inner == merge_after and round_ > 0:
                anchor, momentum = outer_step(anchor, momentum, means[round_ - 1], outer)
                merged += 1
            assert torch.allclose(results[0][f"{key}/anchor"][t].double(), anchor, atol=tolerance, rtol=0), (key, t)
            # the speeds of a round's sum (every rank's, summed) only at its merge: one look a round
            speeds = sum(range(1, len(results) + 1)) - 1 if inner == merge_after and round_ > 0 else -1
            assert all(r[f"{key}/speeds"][t] == speeds for r in results), (key, t)
            # the inner steps carry nothing: a sum starts only at a round's end, the training thread
            # waits only at a merge (what 11bd114's slowdown was first taken for; guarded all the same)
            assert all(bool(r[f"{key}/started"][t]) == (inner == every) for r in results), (key, t)
            if not (inner == merge_after and round_ > 0):
                before = [r[f"{key}/waited"][t - 1] if t else 0.0 for r in results]
                assert all(r[f"{key}/waited"][t] == b for r, b in zip(results, before)), (key, t)
            for r in results:
                after, start = r[f"{key}/after"][t], r[f"{key}/start"][t]
                expected = r[f"{key}/anchor"][t] - (start - after) if inner == merge_after and round_ > 0 else after
                assert torch.equal(r[f"{key}/params"][t], expected), (key, t)
        if merged < len(ends):  # flush(): the last full round's mean if not merged yet, then the cut-short round's
            anchor, momentum = outer_step(anchor, momentum, means[-1], outer)
        last, steps = len(results[0][f"{key}/after"]) - 1, len(results[0][f"{key}/after"]) % every
        cut_short = torch.stack([round_weight(r, key, last, steps) * r[f"{key}/cut-short"].double() for r in results])
        cut_short = cut_short.mean(0)
        anchor, momentum = outer_step(anchor, momentum, cut_short, outer)
        assert torch.allclose(results[0][f"{key}/final"].double(), anchor, atol=tolerance, rtol=0), key
