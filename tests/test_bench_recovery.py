"""bench/recovery.py end to end on loopback, one trial of each: a kill, a SIGSTOP, a join, and one
pair of epochs for the steady-state cost. Only that it runs and measures what it says; the
numbers themselves are the benchmark's (bench/README.md)."""

import json
import os
import sys

import procs
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(400)
def test_one_trial_of_each(tmp_path):
    result = procs.run(
        [
            sys.executable,
            os.path.join(REPO, "bench", "recovery.py"),
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
