"""Slurm's scontrol, run: it expands the host lists as utils/setup/slurm.py does (where it is
installed), and rank 0's requeue through it (a stand-in scontrol on PATH). (The rest of srun's
environment, no process started: tests/unit/test_slurm_environment.py.)"""

import os
import shutil
import subprocess
import types

import pytest
from slurm_env import HOSTLISTS

from utils.setup import slurm


def test_the_expansion_matches_scontrol(tmp_path):
    """Slurm's own parser, where it is installed (CI installs it for the Slurm tests)."""
    if shutil.which("scontrol") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("scontrol is not installed; .ci/run installs slurm-wlm")
        pytest.skip("scontrol is not installed")
    conf = tmp_path / "slurm.conf"  # show hostnames reads no daemon, only needs a configuration
    conf.write_text("ClusterName=test\nSlurmctldHost=localhost\nNodeName=localhost\n")
    for text, expected in HOSTLISTS.items():
        shown = subprocess.run(
            ["scontrol", "show", "hostnames", text],
            capture_output=True,
            text=True,
            timeout=30,
            env=dict(os.environ, SLURM_CONF=str(conf)),
        )
        assert shown.stdout.split() == expected, (text, shown.stderr)


def fake_scontrol(tmp_path, monkeypatch, on_requeue):
    """An `scontrol` on PATH: `show job` says the job may be requeued; `requeue` runs `on_requeue`."""
    script = tmp_path / "scontrol"
    script.write_text(
        '#!/bin/sh\nif [ "$1" = show ]; then echo "JobId=7 BatchFlag=1 Requeue=1"; exit 0; fi\n' + on_requeue + "\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")


def test_a_requeue_whose_scontrol_slurm_kills_with_the_step_is_a_requeue(tmp_path, monkeypatch):
    fake_scontrol(tmp_path, monkeypatch, "kill -TERM $$")  # as slurmstepd ends the step at once
    step = types.SimpleNamespace(job_id="7")
    assert slurm.requeue(step, "runs/checkpoint.pt").startswith("requeued Slurm job 7")


def test_a_requeue_slurm_refuses_says_so(tmp_path, monkeypatch):
    fake_scontrol(tmp_path, monkeypatch, "echo 'Requested operation is presently disabled' >&2; exit 1")
    step = types.SimpleNamespace(job_id="7")
    line = slurm.requeue(step, "runs/checkpoint.pt")
    assert line == "could not requeue Slurm job 7: scontrol requeue 7: Requested operation is presently disabled"
