"""bench/time_to_accuracy/time_to_accuracy.py (issues #13, #24): its pure parts, and torch's local SGD as the bench
builds it (in a world of one). Two quick runs end to end: test_bench_time_to_accuracy_runs.py."""

import os

import pytest
import time_to_accuracy as tta
import time_to_accuracy_report as report
from time_to_accuracy_worker import eval_steps

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "bench", "time_to_accuracy", "time_to_accuracy.py")


def test_configurations_parse_and_nothing_else_does():
    assert tta.parse_config("ours") == {"name": "ours", "kind": "ours", "compress": "none", "sync_every": 1}
    assert tta.parse_config("ddp+powersgd") == {
        "name": "ddp+powersgd",
        "kind": "ddp",
        "compress": "powersgd",
        "sync_every": 1,
    }
    assert tta.parse_config("ours+bf16")["compress"] == "bf16" and tta.parse_config("ddp+fp16")["kind"] == "ddp"
    assert tta.parse_config("ours+bf16@16") == {
        "name": "ours+bf16@16",
        "kind": "ours",
        "compress": "bf16",
        "sync_every": 16,
    }
    assert tta.parse_config("ours@4") == {"name": "ours@4", "kind": "ours", "compress": "none", "sync_every": 4}
    assert tta.parse_config("ours+fp16@64")["compress"] == "fp16" and "merge_after" not in tta.parse_config("ours@64")
    assert tta.parse_config("ours+fp16@64:32")["merge_after"] == 32 and tta.parse_config("ours@8:8")["sync_every"] == 8
    for bad in ("ours@8:0", "ours@8:9", "ours@8:", "ours:4", "localsgd@8:2", "ours@8:x"):
        with pytest.raises(ValueError):
            tta.parse_config(bad)
    assert tta.parse_config("localsgd@2") == {
        "name": "localsgd@2",
        "kind": "localsgd",
        "compress": "none",
        "sync_every": 2,
    }
    for bad in ("ours+none", "ddp+int8", "gloo", "ours+", "", "ours+bf16+fp16"):
        with pytest.raises(ValueError, match="unknown configuration"):
            tta.parse_config(bad)
    for bad, why in (
        ("ours@1", "H >= 2"),
        ("ours@0", "H >= 2"),
        ("localsgd", "localsgd@H needs a period H >= 2"),
        ("localsgd@1", "H >= 2"),
        ("localsgd+bf16@8", "no \\+C"),
        ("ours+powersgd@8", "refuses powersgd"),
        ("ddp@4", "DDP sums every step"),
        ("ddp+fp16@4", "DDP"),
        ("ours@x", "whole number"),
        ("ours@", "whole number"),
        ("ours@-2", "whole number"),
        ("ours@8@8", "whole number"),
    ):
        with pytest.raises(ValueError, match=why):
            tta.parse_config(bad)
    assert tta.parse_ours("ring+overlap+lazy") == {"allreduce": "ring", "overlap": True, "lazy_update": True}
    assert tta.parse_ours("two-pass") == {"allreduce": "two-pass", "overlap": False, "lazy_update": False}
    for bad in ("ring+lazy", "nccl+overlap", "ring+overlap+lazy+bf16"):
        with pytest.raises(ValueError):
            tta.parse_ours(bad)


def test_evaluation_points_are_evenly_spaced_and_end_each_epoch():
    assert tta.DEFAULTS["evals_per_epoch"] == 16  # issue #24: 4 a epoch cannot resolve a 10% target
    assert eval_steps(937, 16) == [59, 117, 176, 234, 293, 351, 410, 468, 527, 586, 644, 703, 761, 820, 878, 937]
    assert eval_steps(937, 4) == [234, 468, 703, 937]
    assert eval_steps(10, 1) == [10]
    assert eval_steps(3, 8) == [1, 2, 3]  # never more points than steps, never twice


def points(*accuracies, spe=4):
    return [{"step": i, "epoch": i / spe, "seconds": 10.0 * i, "accuracy": a} for i, a in enumerate(accuracies)]


def test_time_to_target_is_the_first_point_at_or_above_it():
    ps = points(0.1, 0.98, 0.99, 0.985, 0.995)
    assert report.time_to_target(ps, 0.99)["seconds"] == 20.0  # reached exactly counts, later dips don't matter
    assert report.time_to_target(ps, 0.9999) is None
    assert report.time_to_target([], 0.99) is None
    assert report.accuracy_after_epoch(points(0.1, 0.5, 0.9, 0.95, 0.97, 0.98, 0.99, 0.991, 0.992), 1, 4) == 0.97
    assert report.accuracy_after_epoch(points(0.1, 0.5, 0.9, 0.95, 0.97, 0.98, 0.99, 0.991, 0.992), 2, 4) == 0.992
    assert report.accuracy_after_epoch(points(0.1, 0.5), 1, 4) is None


def test_summary_and_free_network():
    raw = {
        "points": points(0.1, 0.97, 0.99, 0.991, 0.992, spe=2),
        "steps_per_epoch": 2,
        "steps": 4,
        "batch_size": 32,
        "compute_step_s": 0.5,
        "train_seconds": 40.0,
        "wall_seconds": 50.0,
        "wire_bytes": [4000, 6000],
        "sent_bytes": [3000, 3000],
        "counts_bytes": True,
        "params_identical": True,
    }
    r = report.summarize(raw, {"name": "ours", "kind": "ours", "compress": "none"}, 2, 0.99, 2)
    assert r["time_to_target_s"] == 20.0 and r["steps_to_target"] == 2 and r["epochs_to_target"] == 1.0
    assert r["compute_x_steps_to_target_s"] == 1.0 and r["compute_x_steps_s"] == 2.0
    assert r["accuracy_by_epoch"] == {"1": 0.99, "2": 0.992} and r["ms_per_step"] == 10000.0
    assert r["wire_kb_per_step"] == 1.25 and r["sent_kb_per_step"] == 0.75
    ddp = dict(r, config="ddp", kind="ddp", compute_ms_per_step=700.0)
    free = report.free_network(
        [
            dict(r, compute_ms_per_step=500.0),
            ddp,
            dict(r, config="ours+bf16", compress="bf16", compute_ms_per_step=600.0),
        ]
    )
    assert free["of"] == "ours" and free["ms_per_step"] == 600.0 and free["to_target_s"] == pytest.approx(1.2)
    assert "| 2 | ours ring+overlap+lazy | 20.0 | 2 (1.00) | 1.0 | 20.00x | 99.00% | 99.20% |" in report.table(
        [r], "ring+overlap+lazy", 0.99, 2
    )


def test_a_quick_or_partial_run_never_overwrites_the_full_results(monkeypatch):
    parsed = []
    monkeypatch.setattr(tta, "run_driver", lambda driver, args, name: parsed.append(args) or 0)

    def stem(*argv):
        assert tta.main(list(argv)) == 0
        args = parsed.pop()
        return tta.results_stem(args, "loopback" if args.loopback else "cluster")

    assert stem() == "time_to_accuracy-cluster"
    assert stem("--configs", "ddp,ours,ours+bf16,ours+powersgd,ddp+fp16,ddp+powersgd") == "time_to_accuracy-cluster"
    assert stem("--loopback", "--rate", "1gbit") == "time_to_accuracy-loopback"
    assert stem("--rate", "1gbit", "--world-sizes", "2") == "time_to_accuracy-cluster-1gbit-n2"
    assert stem("--epochs", "1", "--train-subset", "6400") == "time_to_accuracy-cluster-e1-sub6400"
    assert stem("--configs", "ours") == "time_to_accuracy-cluster-subset"
    assert (
        stem(
            "--world-sizes",
            "4",
            "--evals-per-epoch",
            "2",
            "--configs",
            "ours+powersgd,ddp+powersgd,ours+bf16,ddp+fp16,ours,ddp",
        )
        == "time_to_accuracy-cluster-n4-ev2"
    )
    assert stem("--powersgd-rank", "2") == "time_to_accuracy-cluster-r2w10"
    assert stem("--ours", "gloo+overlap") == "time_to_accuracy-cluster-gloo+overlap"
    assert stem("--repeats", "3") == "time_to_accuracy-cluster-x3"
    assert stem("--evals-per-epoch", "16") == "time_to_accuracy-cluster"
    assert stem("--evals-per-epoch", "4") == "time_to_accuracy-cluster-ev4"
    assert stem("--rates", "200mbit") == "time_to_accuracy-cluster"
    assert stem("--rates", "20mbit,1gbit", "--world-sizes", "2") == "time_to_accuracy-cluster-20mbit+1gbit-n2"
    assert stem("--loopback", "--rates", "20mbit,1gbit") == "time_to_accuracy-loopback"
    assert stem("--configs", "ours+bf16@16,localsgd@16", "--outer", "average") == "time_to_accuracy-cluster-subset"
    assert stem("--configs", "ours@16", "--outer", "nesterov") == "time_to_accuracy-cluster-nesterov-subset"
    assert (
        stem("--configs", "ours@16", "--outer", "nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.9")
        == "time_to_accuracy-cluster-nesterov-subset"
    )  # the defaults, spelt out
    assert (
        stem("--configs", "ours@16", "--outer", "nesterov", "--outer-lr", "0.5", "--outer-momentum", "0.8")
        == "time_to_accuracy-cluster-nesterov-olr0.5-om0.8-subset"
    )
    assert stem("--localsgd-warmup", "4") == "time_to_accuracy-cluster-lw4"
    args = (tta.main(["--configs", "ours@16", "--outer", "nesterov", "--outer-lr", "0.5"]), parsed.pop())[1]
    assert tta.outer_settings(args) == (0.5, 0.9) and args.rates == ["200mbit"]
    for bad in (
        ["--rate", "1gbit", "--rates", "20mbit"],
        ["--outer-lr", "0.5"],
        ["--rates", "20mbit,20mbit"],
        ["--outer", "nesterov"],
        ["--configs", "localsgd"],
        ["--localsgd-warmup", "-1"],
    ):
        with pytest.raises(SystemExit) as e:
            tta.main(bad)
        assert e.value.code == 2 and not parsed


def test_repeats_give_medians_and_each_run_against_our_best():
    def record(config, kind, run, seconds, ms):
        return {
            "config": config,
            "kind": kind,
            "run": run,
            "world_size": 2,
            "time_to_target_s": seconds,
            "ms_per_step": ms,
            "compute_x_steps_to_target_s": 20.0,
        }

    records = [
        record("ours+powersgd", "ours", 1, 30.0, 25.0),
        record("ddp+powersgd", "ddp", 1, 33.0, 27.0),
        record("ours+powersgd", "ours", 2, 36.0, 29.0),
        record("ddp+powersgd", "ddp", 2, 30.0, 26.0),
        record("ours+powersgd", "ours", 3, 31.0, 26.0),
        record("ddp+powersgd", "ddp", 3, 40.0, 30.0),
        record("ours+bf16", "ours", 1, None, 40.0),
        record("ours+bf16", "ours", 2, 50.0, 41.0),
        record("ours+bf16", "ours", 3, 51.0, 42.0),
    ]
    lines = report.medians(records, "two-pass", 0.99).splitlines()
    assert lines[2] == "| 2 | ours two-pass+powersgd | 3 | 31.0 | 30.0, 36.0, 31.0 | 26.0 | 1.55x |  |"
    assert lines[3] == (
        "| 2 | ddp+powersgd | 3 | 33.0 | 33.0, 30.0, 40.0 | 27.0 | 1.65x | "
        "ours two-pass+powersgd: 0.909x, 1.200x, 0.775x |"
    )
    assert lines[4] == "| 2 | ours two-pass+bf16 | 3 | not reached | -, 50.0, 51.0 | 41.0 | - |  |"
    assert report.label(records[2], "two-pass") == "ours two-pass+powersgd (run 2)"


def run_record(config, rate, run, seconds, steps=None, acc=(0.98, 0.99), wire=None, n=2):
    """A synthetic record, as summarize() and run_all() make it, for the tables."""
    spec = tta.parse_config(config)
    return {
        "config": config,
        "kind": spec["kind"],
        "compress": spec["compress"],
        "sync_every": spec["sync_every"],
        "rate": rate,
        "run": run,
        "world_size": n,
        "time_to_target_s": seconds,
        "steps_to_target": steps,
        "accuracy_by_epoch": {"1": acc[0], "2": acc[1]},
        "wire_kb_per_step": wire,
        "ms_per_step": 20.0,
        "compute_x_steps_to_target_s": 10.0,
        "epochs_to_target": steps and steps / 1000,
        "steps": 2000,
        "train_seconds": 60.0,
        "compute_ms_per_step": 10.0,
        "params_identical": True,
    }


def test_h_by_link_table_has_a_column_group_per_rate_and_medians_in_it():
    records = [
        run_record("ours+bf16@16", "20mbit", 1, 30.0, 1000, (0.985, 0.992), 14.0),
        run_record("ours+bf16@16", "20mbit", 2, 34.0, 1100, (0.987, 0.991), 16.0),
        run_record("ours+bf16@16", "20mbit", 3, 31.0, 1000, (0.986, 0.990), 15.0),
        run_record("localsgd@16", "20mbit", 1, 90.0, 1044, (0.988, 0.9925), 60.0),
        run_record("localsgd@16", "20mbit", 2, None, None, (0.980, 0.985), 61.0),
        run_record("localsgd@16", "20mbit", 3, 95.0, 1044, (0.989, 0.993), 62.0),
        run_record("ours+bf16@16", "1gbit", 1, 20.0, 1000, (0.985, 0.992), 14.5),
    ]
    lines = report.h_by_link(records, ["20mbit", "1gbit"], "ring+overlap+lazy", 0.99, 2).splitlines()
    assert lines[0] == (
        "| N | configuration | 20mbit: time to 99.0% (s) | 20mbit: steps to it | 20mbit: acc after 1 ep "
        "| 20mbit: acc after 2 ep | 20mbit: wire KB/step/rank | 1gbit: time to 99.0% (s) "
        "| 1gbit: steps to it | 1gbit: acc after 1 ep | 1gbit: acc after 2 ep | 1gbit: wire KB/step/rank |"
    )
    assert lines[1] == "|--:|:--|" + "--:|" * 10
    # ours@H: the algorithm alone (no per-step sum to overlap or make lazy); medians over the three runs
    assert lines[2] == (
        "| 2 | ours ring+bf16@16 | 31.0 | 1000 | 98.60% | 99.10% | 15 | 20.0 | 1000 | 98.50% | 99.20% | 14 |"
    )
    # a run that never reached the target: no median time; no run at a rate: dashes
    assert lines[3] == "| 2 | localsgd@16 | not reached | - | 98.80% | 99.25% | 61 | - | - | - | - | - |"
    assert len(lines) == 4
    assert report.h_by_link(records, ["20mbit"], "two-pass", 0.99, 1).splitlines()[0].count("acc after") == 1

    md = report.tables(records, ["20mbit", "1gbit"], "ring+overlap+lazy", 0.99, 2, 3)
    assert "#### 20mbit" in md and "#### 1gbit" in md and "H x link (medians over 3 run(s) each)" in md
    assert md.count("Medians over 3 runs") == 2
    plain = [dict(r, config="ours", sync_every=1, rate="200mbit") for r in records[:3]]
    md = report.tables(plain, ["200mbit"], "ring", 0.99, 2, 1)  # one rate, no @H: today's table alone
    assert "H x link" not in md and "####" not in md and "Medians" not in md and md.startswith("| N |")


def test_medians_set_our_best_against_local_sgd_and_give_the_headline_ratios():
    records = []
    for run, (o16, o64, loc, ddp, psgd) in enumerate(
        [(20.0, 22.0, 50.0, 40.0, 39.0), (21.0, 19.0, 44.0, 42.0, 41.0), (22.0, 23.0, 46.0, 41.0, 45.0)], 1
    ):
        records += [
            run_record("ours+bf16@16", "20mbit", run, o16),
            run_record("ours+bf16@64", "20mbit", run, o64),
            run_record("localsgd@16", "20mbit", run, loc),
            run_record("ddp+powersgd", "20mbit", run, ddp),
            run_record("ours+powersgd", "20mbit", run, psgd),
        ]
    lines = report.medians(records, "two-pass", 0.99).splitlines()
    assert lines[2] == "| 2 | ours two-pass+bf16@16 | 3 | 21.0 | 20.0, 21.0, 22.0 | 20.0 | 2.10x |  |"
    # our best by median is ours@16 (21.0 s, against @64's 22.0): every run of it against local SGD's, run by run
    assert lines[4] == (
        "| 2 | localsgd@16 | 3 | 46.0 | 50.0, 44.0, 46.0 | 20.0 | 4.60x | "
        "ours two-pass+bf16@16: 0.400x, 0.477x, 0.478x |"
    )
    assert lines[5].startswith("| 2 | ddp+powersgd | 3 | 41.0 |") and lines[5].endswith(
        "ours two-pass+bf16@16: 0.500x, 0.500x, 0.537x |"
    )
    assert lines[6].endswith("|  |")  # ours against ours: no pairing
    assert lines[7] == ""
    assert lines[8] == (
        "20mbit N=2: best localsgd@H / best ours@H, median time to 99.0%: 2.19x "
        "(localsgd@16 46.0 s; ours two-pass+bf16@16 21.0 s)  "
    )
    assert lines[9] == (
        "20mbit N=2: ddp+powersgd / best ours, median time to 99.0%: 1.95x "
        "(ddp+powersgd 41.0 s; ours two-pass+bf16@16 21.0 s)  "
    )
    assert len(lines) == 10
    unreached = [dict(r, time_to_target_s=None) if r["kind"] == "localsgd" else r for r in records]
    assert report.medians(unreached, "two-pass", 0.99).splitlines()[8] == (
        "20mbit N=2: best localsgd@H / best ours@H, median time to 99.0%: - "
        "(localsgd@16: not reached; ours two-pass+bf16@16 21.0 s)  "
    )
    only_per_step = [r for r in records if r["config"] in ("ours+powersgd", "localsgd@16")]
    assert "best localsgd@H" not in report.medians(only_per_step, "two-pass", 0.99)  # no ours@H to set against it


def test_local_sgd_is_torchs_and_the_schedule_drives_its_inner_adam():
    """In a world of one (gloo, in this process): torch's pieces, put together as its docs do; the
    averager counts every step; the one-cycle rate the scheduler sets on the inner Adam is the rate the
    wrapped optimizer steps with; flush() is the end's average."""
    import torch
    import torch.distributed as dist
    from harness import free_port
    from peers import LocalStep, average_parameters, make_localsgd
    from torch.distributed.optim import PostLocalSGDOptimizer

    from utils.learn.model import Net
    from utils.learn.training import make_optimizer
    from utils.run import train_step
    from utils.setup.config import Recipe
    from utils.sync.interface import DistributedOptimizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = Net()
        optimizer, scheduler = make_optimizer(net, Recipe(epochs=1), 40)  # peak rate at step 6
        ddp, wrapped = make_localsgd(net, optimizer, period=2, warmup=3)
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and ddp.module is net
        assert isinstance(wrapped, PostLocalSGDOptimizer) and wrapped.optim is optimizer
        assert (wrapped.averager.period, wrapped.averager.warmup_steps) == (2, 3)
        sync, rates = LocalStep(wrapped, scheduler, at_end=lambda: average_parameters(net)), []
        view = DistributedOptimizer(sync)
        for _ in range(5):
            rates.append(optimizer.param_groups[0]["lr"])
            train_step(ddp, torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3]), sync, view)
        assert wrapped.averager.step == 5
        assert rates[0] < rates[1] < rates[4] and wrapped.param_groups[0]["lr"] == scheduler.get_last_lr()[0]
        before = [p.detach().clone() for p in net.parameters()]
        sync.flush()  # the end's average: a world of one keeps its bits
        assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
    finally:
        dist.destroy_process_group()


def test_defaults_follow_the_trainer():
    from utils.comm.compress import DEFAULT_POWERSGD_RANK, DEFAULT_POWERSGD_WARMUP

    assert (tta.DEFAULTS["powersgd_rank"], tta.DEFAULTS["powersgd_warmup"]) == (
        DEFAULT_POWERSGD_RANK,
        DEFAULT_POWERSGD_WARMUP,
    )
    from utils.setup.config import GLOBAL_BATCH

    assert tta.DEFAULTS["global_batch"] == GLOBAL_BATCH
    from utils.learn.model import Net

    assert sum(p.numel() for p in Net().parameters()) == tta.MODEL_NUMEL
