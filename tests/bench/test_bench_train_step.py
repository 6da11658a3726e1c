"""bench/train_step/train_step.py end to end on loopback: it runs every configuration and writes its results."""

import json
import os
import sys

import procs
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "bench", "train_step", "train_step.py")
CONFIGS = {
    "compute-alone",
    "compute",
    "compute+wire",
    "compute+sync",
    "two-pass",
    "two-pass+overlap",
    "two-pass+overlap+lazy",
    "ring",
    "ring+overlap",
    "ring+overlap+lazy",
    "gloo",
    "gloo+overlap",
    "gloo+overlap+lazy",
    "ddp",
}


@pytest.mark.timeout(180)
def test_loopback_run_measures_every_configuration(tmp_path):
    # The benchmark kills its own ranks on every exit path (and has its own --timeout per world);
    # the outer timeout is a last resort.
    r = procs.run(
        [
            sys.executable,
            BENCH,
            "--loopback",
            "--world-sizes",
            "2",
            "--warmup",
            "1",
            "--iters",
            "3",
            "--steps-per-sample",  # 2, not 6: a lazy update still carries over from a sample's first step
            "2",
            "--timeout",
            "150",
            "--results-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        timeout=170,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "train_step-loopback-n2.json").read_text())
    rows = data["results"]
    assert {row["config"] for row in rows} == CONFIGS
    assert len(rows) == len(CONFIGS)
    for row in rows:
        assert row["world_size"] == 2 and row["iters"] == 3 and len(row["step_ms"]) == 3
        assert row["median_ms"] > 0 and all(t > 0 for t in row["step_ms"]), row
        assert row["images_per_s_per_rank"] > 0
        if row["kind"] == "sum" or row["kind"] == "ddp":  # every summed configuration ends bit-identical
            assert row["params_identical"] is True, row["config"]
        else:  # compute-only ranks (and the two floors) never share gradients
            assert row["params_identical"] is None, row["config"]
    by = {row["config"]: row for row in rows}
    assert by["two-pass"]["chunks"] == by["two-pass+overlap"]["chunks"] == "auto"  # resolved as train.py does
    assert by["gloo+overlap"]["overlap"] is True and by["gloo"]["overlap"] is False
    assert by["two-pass+overlap"]["same_bits_as_plain"] is True  # two-pass adds in one order, bucketed or not
    assert by["two-pass+overlap+lazy"]["same_bits_as_plain"] is True  # and Adam updates each parameter alone
    assert by["ring+overlap+lazy"]["lazy"] is True and by["ring+overlap"]["lazy"] is False
    assert data["params_identical"] is True and data["batch_size"] == {"2": 32}
    assert any(t["target"] == "best >= DDP throughput" and t["status"] == "info" for t in data["targets"])
    png = (tmp_path / "train_step-loopback-n2.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "| rate | N | batch | configuration |" in r.stdout and "| loopback | 2 | 32 | ddp |" in r.stdout
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.timeout(120)
def test_reference_model_is_the_issues_baseline_cnn(tmp_path):
    r = procs.run(
        [
            sys.executable,
            BENCH,
            "--loopback",
            "--world-sizes",
            "2",
            "--warmup",
            "1",
            "--iters",
            "2",
            "--steps-per-sample",
            "2",
            "--model",
            "reference",
            "--only",
            "gloo",
            "--timeout",
            "100",
            "--results-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        timeout=110,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "train_step-loopback-n2-reference-subset.json").read_text())
    assert data["model"] == "reference" and data["model_parameters"] == 1_199_882
    by = {row["config"]: row for row in data["results"]}
    assert set(by) == {"compute-alone", "compute", "compute+sync", "compute+wire", "gloo", "ddp"}
    assert by["gloo"]["params_identical"] is True and by["ddp"]["params_identical"] is True
    assert (
        "reference model (1,199,882 parameters)"
        in (tmp_path / "train_step-loopback-n2-reference-subset.md").read_text()
    )
    from train_step import MODEL_NUMEL, make_model

    for name, numel in MODEL_NUMEL.items():  # the constants the wire floor sends are the models' sizes
        assert sum(p.numel() for p in make_model(name).parameters()) == numel


def test_a_partial_or_different_run_never_overwrites_the_full_results(monkeypatch):
    """A run with --rates 1gbit alone once overwrote train_step-cluster.*, which held both rates."""
    import train_step

    parsed = []
    monkeypatch.setattr(train_step, "run_driver", lambda driver, args, name: parsed.append(args) or 0)

    def stem(*argv):
        assert train_step.main(list(argv)) == 0
        args = parsed.pop()
        return train_step.results_stem(args, "loopback" if args.loopback else "cluster")

    assert stem() == "train_step-cluster"
    assert stem("--loopback") == "train_step-loopback"
    assert stem("--rates", "1gbit") == "train_step-cluster-1gbit"
    assert stem("--rates", "1gbit", "--world-sizes", "2", "--batch-size", "64") == "train_step-cluster-1gbit-n2-b64"
    assert stem("--batch-size", "64", "--model", "reference") == "train_step-cluster-reference-b64"
    assert stem("--global-batch", "64") == "train_step-cluster-gb64"
    assert stem("--only", "gloo") == stem("--algorithms", "ring") == "train_step-cluster-subset"
    assert stem("--loopback", "--rates", "1gbit") == "train_step-loopback"  # no capped links there


def test_compression_rows_and_their_file_names(monkeypatch):
    """--compression (issue #13) adds ours compressed and DDP's hooks, and names its files after itself."""
    import train_step

    parsed = []
    monkeypatch.setattr(train_step, "run_driver", lambda driver, args, name: parsed.append(args) or 0)

    def run(*argv):
        assert train_step.main(list(argv)) == 0
        args = parsed.pop()
        return args, train_step.results_stem(args, "loopback" if args.loopback else "cluster")

    args, stem = run("--compression")
    assert stem == "train_step-cluster-compression"
    names = [c["name"] for c in train_step.make_configs(args)]
    assert names[-6:] == [
        "ring+overlap+lazy+fp16",
        "ring+overlap+lazy+bf16",
        "ring+overlap+lazy+powersgd",
        "ddp+fp16",
        "ddp+bf16",
        "ddp+powersgd",
    ]
    by = {c["name"]: c for c in train_step.make_configs(args)}
    assert by["ring+overlap+lazy+powersgd"] == {
        "name": "ring+overlap+lazy+powersgd",
        "kind": "sum",
        "allreduce": "ring",
        "overlap": True,
        "lazy": True,
        "compress": "powersgd",
        "chunks": None,
        "bucket_mb": 1.0,
    }
    assert by["ddp+powersgd"] == {"name": "ddp+powersgd", "kind": "ddp", "hook": "powersgd"}
    args, stem = run(
        "--compression", "--only", "gloo", "--compress", "powersgd", "--compress-with", "gloo+overlap,two-pass"
    )
    assert stem == "train_step-cluster-subset-compression-powersgd-with-gloo-ov+two-pass"
    names = [c["name"] for c in train_step.make_configs(args)]  # --only keeps every compressed row
    assert names[-3:] == ["gloo+overlap+powersgd", "two-pass+powersgd", "ddp+powersgd"] and "gloo" in names
    assert (
        train_step.make_configs(args)[-2]["chunks"] == "auto"
    )  # two-pass plain: resolved by the hosts, as train.py does
    assert run("--compression", "--powersgd-rank", "2")[1] == "train_step-cluster-compression-r2w10"
    assert run()[1] == "train_step-cluster"  # the default plan's name is unchanged
    from utils.comm.compress import DEFAULT_POWERSGD_RANK, DEFAULT_POWERSGD_WARMUP

    assert (train_step.DEFAULTS["powersgd_rank"], train_step.DEFAULTS["powersgd_warmup"]) == (
        DEFAULT_POWERSGD_RANK,
        DEFAULT_POWERSGD_WARMUP,
    )


def test_compression_targets():
    """200 Mbit/s: ours powersgd <= 1.02x DDP+PowerSGD (and <= 1.30x compute at N=2), ours bf16 <= 1.02x
    the better DDP hook; both the medians' ratio and the paired one must be within the bound."""
    import train_step_report as report

    def row(config, kind, ms, compress=None, n=2, rate_bits=200 * 10**6):
        return {
            "config": config,
            "kind": kind,
            "compress": compress,
            "step_ms": ms,
            "median_ms": sorted(ms)[1],
            "rate": "200mbit",
            "rate_bits_per_s": rate_bits,
            "world_size": n,
        }

    rows = [
        row("compute", "compute", [20, 20, 20]),
        row("compute+sync", "sync", [22, 22, 22]),
        row("ring+overlap+lazy+powersgd", "sum", [25, 25, 25], "powersgd"),
        row("gloo+overlap+lazy+powersgd", "sum", [30, 30, 30], "powersgd"),
        row("ddp+powersgd", "ddp", [25, 24.4, 25], "powersgd"),
        row("ring+overlap+lazy+bf16", "sum", [50, 50, 50], "bf16"),
        row("ddp+fp16", "ddp", [60, 60, 60], "fp16"),
        row("ddp+bf16", "ddp", [40, 55, 56], "bf16"),
    ]
    t = {x["target"]: x for x in report.compression_targets(rows)}
    psgd = t["powersgd <= 1.02x DDP+PowerSGD"]
    assert psgd["best"] == "ring+overlap+lazy+powersgd" and psgd["status"] == "PASS"  # 25/25 and paired 1.0
    assert (
        t["powersgd N=2 <= 1.30x compute"]["status"] == "PASS" and t["powersgd N=2 <= 1.30x compute"]["sync_ms"] == 22
    )
    bf16 = t["bf16 <= 1.02x DDP+fp16/bf16 hook"]
    assert bf16["peer"] == "ddp+bf16" and bf16["ratio"] == pytest.approx(50 / 55)
    # the medians pass (50/55) but the paired median (50/55, 50/56, 50/40 -> 0.909) too; make the paired one miss
    rows[-1] = row("ddp+bf16", "ddp", [45, 55, 45.5], "bf16")  # median 45.5: 50/45.5 = 1.10 -> MISS
    assert {x["target"]: x for x in report.compression_targets(rows)}["bf16 <= 1.02x DDP+fp16/bf16 hook"][
        "status"
    ] == "MISS"
    assert report.compression_targets([dict(r, rate_bits_per_s=10**9) for r in rows]) == []  # 200 Mbit/s only
    n4 = report.compression_targets([dict(r, world_size=4) for r in rows])
    assert "powersgd N=2 <= 1.30x compute" not in {x["target"] for x in n4} and len(n4) == 2
    lines = report.target_lines(report.compression_targets(rows))
    assert "PASS  powersgd <= 1.02x DDP+PowerSGD" in lines and "floor: compute+sync" in lines


def test_timeline_rows_and_their_overhead_target(monkeypatch):
    """--timeline (issue #15) runs each of our configurations again recording a timeline; the target:
    on <= 1.02x off, both the medians' ratio and the paired one."""
    import train_step
    import train_step_report as report

    parsed = []
    monkeypatch.setattr(train_step, "run_driver", lambda driver, args, name: parsed.append(args) or 0)
    assert train_step.main(["--loopback", "--only", "ring+overlap+lazy", "--timeline"]) == 0
    args = parsed.pop()
    assert train_step.results_stem(args, "loopback") == "train_step-loopback-subset-timeline"
    assert train_step.make_configs(args)[-1]["name"] == "ring+overlap+lazy+timeline"
    assert [c for c in train_step.make_configs(args) if c.get("timeline")] == [
        dict(
            next(c for c in train_step.make_configs(args) if c["name"] == "ring+overlap+lazy"),
            name="ring+overlap+lazy+timeline",
            timeline=True,
        )
    ]

    def row(config, ms):
        return {"config": config, "step_ms": ms, "median_ms": sorted(ms)[1], "rate": None, "world_size": 2}

    on = [row("ring+overlap+lazy", [40, 40, 40]), row("ring+overlap+lazy+timeline", [40.4, 40.6, 40.2])]
    (t,) = report.timeline_targets(on)
    assert t["status"] == "PASS" and t["ratio"] == pytest.approx(40.4 / 40)
    (t,) = report.timeline_targets([on[0], row("ring+overlap+lazy+timeline", [41, 41, 41])])
    assert t["status"] == "MISS"  # 1.025x
    assert "timeline on <= 1.02x off" in report.target_lines([t])
