"""bench/time_to_accuracy/time_to_accuracy.py (issues #13, #24): two quick runs end to end on loopback (its pure
parts: test_bench_time_to_accuracy.py)."""

import json
import os
import sys

import procs
import pytest
import time_to_accuracy as tta

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "bench", "time_to_accuracy", "time_to_accuracy.py")


@pytest.mark.timeout(180)
def test_loopback_run_trains_ours_and_ddp_powersgd(tmp_path):
    # The benchmark kills its own ranks on every exit path (and has its own --timeout per world);
    # the outer timeout is a last resort.
    r = procs.run(
        [
            sys.executable,
            BENCH,
            "--loopback",
            "--world-sizes",
            "2",
            "--epochs",
            "1",
            "--train-subset",
            "640",
            "--test-subset",  # rank 0 scores 3 points a world; the target is 50%
            "200",
            "--evals-per-epoch",
            "2",
            "--configs",
            "ours+powersgd,ddp+powersgd",
            "--powersgd-rank",
            "2",
            "--powersgd-warmup",
            "2",
            "--compute-steps",
            "3",
            "--repeats",
            "2",
            "--target",
            "0.5",
            "--timeout",
            "150",
            "--results-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        timeout=170,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    stem = "time_to_accuracy-loopback-n2-e1-ev2-sub640-test200-r2w2-subset-x2"
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert [(row["config"], row["run"]) for row in data["results"]] == [  # round-robin
        ("ours+powersgd", 1),
        ("ddp+powersgd", 1),
        ("ours+powersgd", 2),
        ("ddp+powersgd", 2),
    ]
    for row in data["results"]:
        assert row["params_identical"] is True and row["steps"] == 10 and row["steps_per_epoch"] == 10
        assert [p["step"] for p in row["points"]] == [0, 5, 10]
        assert row["train_seconds"] > 0 and row["compute_ms_per_step"] > 0
        assert row["points"][0]["seconds"] == 0 and row["points"][-1]["seconds"] == row["train_seconds"]
    ours = data["results"][0]
    assert ours["counts_bytes"] is True and ours["sent_kb_per_step"] > 0
    md = (tmp_path / f"{stem}.md").read_text()
    assert (
        "`python3 bench/time_to_accuracy/time_to_accuracy.py --loopback" in md
        and "| 2 | ours ring+overlap+lazy+powersgd (run 2) |" in md
    )
    assert "Medians over 2 runs" in md and "| 2 | ddp+powersgd | 2 |" in md
    png = (tmp_path / f"{stem}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.timeout(120)
def test_loopback_run_trains_ours_every_h_steps_and_torchs_local_sgd(tmp_path):
    # 1600 images at N=2: 25 steps of 32 a rank; ours@8 sums at steps 8, 16, 24 and its flush at 25,
    # local SGD (4 synchronous steps first) averages after steps 5, 13, 21: neither ends on a sync.
    r = procs.run(
        [
            sys.executable,
            BENCH,
            "--loopback",
            "--world-sizes",
            "2",
            "--epochs",
            "1",
            "--train-subset",
            "1600",
            "--test-subset",
            "500",
            "--evals-per-epoch",
            "2",
            "--configs",
            "ours+bf16@8,localsgd@8",
            "--localsgd-warmup",
            "4",
            "--compute-steps",
            "3",
            "--target",
            "0.5",
            "--timeout",
            "100",
            "--results-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        timeout=110,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    stem = "time_to_accuracy-loopback-n2-e1-ev2-sub1600-test500-lw4-subset"
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert (data["rates"], data["outer"], data["outer_lr"], data["localsgd_warmup"]) == ([None], "average", None, 4)
    ours, local = data["results"]
    assert (ours["config"], ours["kind"], ours["sync_every"], ours["outer"]) == ("ours+bf16@8", "ours", 8, "average")
    assert (local["config"], local["kind"], local["sync_every"], "outer" in local) == (
        "localsgd@8",
        "localsgd",
        8,
        False,
    )
    for row in (ours, local):
        assert row["params_identical"] is True and row["steps"] == 25 and row["rate"] is None
        assert [p["step"] for p in row["points"]] == [0, 12, 25]
        assert row["points"][-1]["seconds"] == row["train_seconds"] > 0  # the end's flush is on the clock
        assert row["reached"] and row["final_accuracy"] > 0.6
    # 3 rounds and the flush: four sums of the model's change, 2 bytes a value (bf16), none per step
    assert ours["sent_kb_per_step"] * 25 * 1e3 == pytest.approx(4 * tta.MODEL_NUMEL * 2, rel=1e-3)
    assert local["counts_bytes"] is False
    md = (tmp_path / f"{stem}.md").read_text()
    assert "H x link (medians over 1 run(s) each)" in md and "| 2 | ours ring+bf16@8 | " in md
    assert "| 2 | localsgd@8 | " in md and "4 synchronous steps first" in md
