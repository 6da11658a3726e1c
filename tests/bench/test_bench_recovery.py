"""bench/recovery/recovery.py end to end on loopback, one trial of each: a kill, a SIGSTOP, a join, and one
pair of epochs for the steady-state cost. Only that it runs and measures what it says; the
numbers themselves are the benchmark's (bench/recovery/NOTES.md)."""

import json
import os
import sys

import procs
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(400)
def test_one_trial_of_each(tmp_path):
    result = procs.run(
        [
            sys.executable,
            os.path.join(REPO, "bench", "recovery", "recovery.py"),
            "--faults",
            "1",
            "--pairs",
            "1",
            "--train-subset",
            "3200",
            "--results-dir",
            str(tmp_path),
        ],
        timeout=360,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for line in (
        "kill: fault -> next step",
        "stop: fault -> next step",
        "join: ready -> first step",
        "steady-state cost, loopback: --recover / --no-recover epoch time",
    ):
        assert line in result.stdout, result.stdout
    saved = json.loads((tmp_path / "recovery-n3.json").read_text())
    assert saved["kill"]["steps_lost"] == [0] and saved["stop"]["steps_lost"] == [0]
    assert 0 < saved["kill"]["median"] < 30 and 2.0 < saved["stop"]["median"] < 60  # a stop is silence: >= heartbeat
    assert 0 < saved["join"]["median"] < 60 and len(saved["cost"]["loopback"]["ratios"]) == 1
    assert "| kill: fault → next completed step (s) |" in (tmp_path / "recovery-n3.md").read_text()


@pytest.mark.timeout(300)
def test_a_cut_link_with_and_without_overlap(needs_root, tmp_path):
    """--only cut: one cut of a server's link on emulated hosts, under --overlap, --no-overlap and gloo's
    own sum; the survivors go on within seconds, not the --timeout (60 s) a stuck receive would wait.
    (Seed 1's first cut is rank 0's server: without utils/sync/interface.py's bound, --no-overlap waited
    out --timeout at 9 of 9 such cuts, and gloo's own sum at 2 of 3 without Recovery.abandoned.)"""
    bench = [
        sys.executable,
        os.path.join(REPO, "bench", "recovery", "recovery.py"),
        "--only",
        "cut",
        "--cut-rate",
        "200mbit",
    ]
    result = procs.run([*bench, "--faults", "1", "--results-dir", str(tmp_path)], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((tmp_path / "recovery-n3-cut-200mbit.json").read_text())
    assert sorted(saved["cut"]) == ["--allreduce=gloo", "--no-overlap", "--overlap"]
    assert all(0 < saved["cut"][flags]["median"] < 30 for flags in saved["cut"]), saved["cut"]
    md = (tmp_path / "recovery-n3-cut-200mbit.md").read_text()
    assert "| cut at 200mbit, --no-overlap: cut → next completed step (s) |" in md
