"""bench/time_to_accuracy.py (issue #13): its pure parts, and one quick run end to end on loopback."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "bench", "time_to_accuracy.py")
sys.path.insert(0, os.path.join(REPO, "bench"))
import time_to_accuracy as tta  # noqa: E402


def test_configurations_parse_and_nothing_else_does():
    assert tta.parse_config("ours") == {"name": "ours", "kind": "ours", "compress": "none"}
    assert tta.parse_config("ddp+powersgd") == {"name": "ddp+powersgd", "kind": "ddp", "compress": "powersgd"}
    assert tta.parse_config("ours+bf16")["compress"] == "bf16" and tta.parse_config("ddp+fp16")["kind"] == "ddp"
    for bad in ("ours+none", "ddp+int8", "gloo", "ours+", "", "ours+bf16+fp16"):
        with pytest.raises(ValueError):
            tta.parse_config(bad)
    assert tta.parse_ours("ring+overlap+lazy") == {"allreduce": "ring", "overlap": True, "lazy_update": True}
    assert tta.parse_ours("two-pass") == {"allreduce": "two-pass", "overlap": False, "lazy_update": False}
    for bad in ("ring+lazy", "nccl+overlap", "ring+overlap+lazy+bf16"):
        with pytest.raises(ValueError):
            tta.parse_ours(bad)


def test_evaluation_points_are_evenly_spaced_and_end_each_epoch():
    assert tta.eval_steps(937, 4) == [234, 468, 703, 937]
    assert tta.eval_steps(10, 1) == [10]
    assert tta.eval_steps(3, 8) == [1, 2, 3]            # never more points than steps, never twice


def points(*accuracies, spe=4):
    return [{"step": i, "epoch": i / spe, "seconds": 10.0 * i, "accuracy": a} for i, a in enumerate(accuracies)]


def test_time_to_target_is_the_first_point_at_or_above_it():
    ps = points(0.1, 0.98, 0.99, 0.985, 0.995)
    assert tta.time_to_target(ps, 0.99)["seconds"] == 20.0        # reached exactly counts, later dips don't matter
    assert tta.time_to_target(ps, 0.9999) is None
    assert tta.time_to_target([], 0.99) is None
    assert tta.accuracy_after_epoch(points(0.1, 0.5, 0.9, 0.95, 0.97, 0.98, 0.99, 0.991, 0.992), 1, 4) == 0.97
    assert tta.accuracy_after_epoch(points(0.1, 0.5, 0.9, 0.95, 0.97, 0.98, 0.99, 0.991, 0.992), 2, 4) == 0.992
    assert tta.accuracy_after_epoch(points(0.1, 0.5), 1, 4) is None


def test_summary_and_free_network():
    raw = {"points": points(0.1, 0.97, 0.99, 0.991, 0.992, spe=2), "steps_per_epoch": 2, "steps": 4,
           "batch_size": 32, "compute_step_s": 0.5, "train_seconds": 40.0, "wall_seconds": 50.0,
           "wire_bytes": [4000, 6000], "sent_bytes": [3000, 3000], "counts_bytes": True, "params_identical": True}
    r = tta.summarize(raw, {"name": "ours", "kind": "ours", "compress": "none"}, 2, 0.99, 2)
    assert r["time_to_target_s"] == 20.0 and r["steps_to_target"] == 2 and r["epochs_to_target"] == 1.0
    assert r["compute_x_steps_to_target_s"] == 1.0 and r["compute_x_steps_s"] == 2.0
    assert r["accuracy_by_epoch"] == {"1": 0.99, "2": 0.992} and r["ms_per_step"] == 10000.0
    assert r["wire_kb_per_step"] == 1.25 and r["sent_kb_per_step"] == 0.75
    ddp = dict(r, config="ddp", kind="ddp", compute_ms_per_step=700.0)
    free = tta.free_network([dict(r, compute_ms_per_step=500.0), ddp, dict(r, config="ours+bf16", compress="bf16",
                                                                           compute_ms_per_step=600.0)])
    assert free["of"] == "ours" and free["ms_per_step"] == 600.0 and free["to_target_s"] == pytest.approx(1.2)
    assert "| 2 | ours ring+overlap+lazy | 20.0 | 2 (1.00) | 1.0 | 20.00x | 99.00% | 99.20% |" in tta.table(
        [r], "ring+overlap+lazy", 0.99, 2)


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
    assert stem("--world-sizes", "4", "--evals-per-epoch", "2", "--configs",
                "ours+powersgd,ddp+powersgd,ours+bf16,ddp+fp16,ours,ddp") == "time_to_accuracy-cluster-n4-ev2"
    assert stem("--powersgd-rank", "2") == "time_to_accuracy-cluster-r2w10"
    assert stem("--ours", "gloo+overlap") == "time_to_accuracy-cluster-gloo+overlap"
    assert stem("--repeats", "3") == "time_to_accuracy-cluster-x3"


def test_repeats_give_medians_and_each_run_against_our_best():
    def record(config, kind, run, seconds, ms):
        return {"config": config, "kind": kind, "run": run, "world_size": 2, "time_to_target_s": seconds,
                "ms_per_step": ms, "compute_x_steps_to_target_s": 20.0}
    records = [record("ours+powersgd", "ours", 1, 30.0, 25.0), record("ddp+powersgd", "ddp", 1, 33.0, 27.0),
               record("ours+powersgd", "ours", 2, 36.0, 29.0), record("ddp+powersgd", "ddp", 2, 30.0, 26.0),
               record("ours+powersgd", "ours", 3, 31.0, 26.0), record("ddp+powersgd", "ddp", 3, 40.0, 30.0),
               record("ours+bf16", "ours", 1, None, 40.0), record("ours+bf16", "ours", 2, 50.0, 41.0),
               record("ours+bf16", "ours", 3, 51.0, 42.0)]
    lines = tta.medians(records, "two-pass", 0.99).splitlines()
    assert lines[2] == "| 2 | ours two-pass+powersgd | 3 | 31.0 | 30.0, 36.0, 31.0 | 26.0 | 1.55x |  |"
    assert lines[3] == ("| 2 | ddp+powersgd | 3 | 33.0 | 33.0, 30.0, 40.0 | 27.0 | 1.65x | "
                        "ours two-pass+powersgd: 0.909x, 1.200x, 0.775x |")
    assert lines[4] == "| 2 | ours two-pass+bf16 | 3 | not reached | -, 50.0, 51.0 | 41.0 | - |  |"
    assert tta.label(records[2], "two-pass") == "ours two-pass+powersgd (run 2)"


def test_defaults_follow_the_trainer():
    from utils.compress import DEFAULT_POWERSGD_RANK, DEFAULT_POWERSGD_WARMUP
    assert (tta.DEFAULTS["powersgd_rank"], tta.DEFAULTS["powersgd_warmup"]) == (DEFAULT_POWERSGD_RANK,
                                                                               DEFAULT_POWERSGD_WARMUP)
    sys.path.insert(0, REPO)
    import train
    assert tta.DEFAULTS["global_batch"] == train.GLOBAL_BATCH
    from utils.model import Net
    assert sum(p.numel() for p in Net().parameters()) == tta.MODEL_NUMEL


@pytest.mark.timeout(180)
def test_loopback_run_trains_ours_and_ddp_powersgd(tmp_path):
    # The benchmark kills its own ranks on every exit path (and has its own --timeout per world);
    # the outer timeout is a last resort.
    r = subprocess.run([sys.executable, BENCH, "--loopback", "--world-sizes", "2", "--epochs", "1",
                        "--train-subset", "640", "--test-subset", "500", "--evals-per-epoch", "2",
                        "--configs", "ours+powersgd,ddp+powersgd", "--powersgd-rank", "2", "--powersgd-warmup", "2",
                        "--compute-steps", "3", "--repeats", "2",
                        "--target", "0.5", "--timeout", "150", "--results-dir", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    stem = "time_to_accuracy-loopback-n2-e1-ev2-sub640-test500-r2w2-subset-x2"
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert [(row["config"], row["run"]) for row in data["results"]] == [   # round-robin
        ("ours+powersgd", 1), ("ddp+powersgd", 1), ("ours+powersgd", 2), ("ddp+powersgd", 2)]
    for row in data["results"]:
        assert row["params_identical"] is True and row["steps"] == 10 and row["steps_per_epoch"] == 10
        assert [p["step"] for p in row["points"]] == [0, 5, 10]
        assert row["train_seconds"] > 0 and row["compute_ms_per_step"] > 0
        assert row["points"][0]["seconds"] == 0 and row["points"][-1]["seconds"] == row["train_seconds"]
    ours = data["results"][0]
    assert ours["counts_bytes"] is True and ours["sent_kb_per_step"] > 0
    md = (tmp_path / f"{stem}.md").read_text()
    assert "`python3 bench/time_to_accuracy.py --loopback" in md and "| 2 | ours ring+overlap+lazy+powersgd (run 2) |" in md
    assert "Medians over 2 runs" in md and "| 2 | ddp+powersgd | 2 |" in md
    png = (tmp_path / f"{stem}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
