"""train.py in a Slurm step's environment, without Slurm: a broken Slurm environment is one line and
exit 2; Slurm's warning (SIGUSR1) while a rank starts stops the job after its first step. Loopback
ranks. (Under a real Slurm: tests/cluster/test_slurm.py.)"""

import os
import re
import signal

import procs
import pytest
from procs import checkpoint_position

# the training of tests/cluster/test_slurm.py (the warning comes long before its end)
TRAINING = ["--train-subset", "9600", "--test-subset", "1000", "--epochs", "2", "--save-every", "20"]


def test_a_broken_slurm_environment_is_one_line_and_exit_2(tmp_path):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for broken, needle in (
        ({"SLURM_PROCID": "0"}, "SLURM_PROCID is set but SLURM_NTASKS, SLURM_JOB_ID"),
        (
            {
                "SLURM_PROCID": "0",
                "SLURM_STEP_ID": "0",
                "SLURM_JOB_ID": "7",
                "SLURM_NODEID": "0",
                "SLURM_STEP_NODELIST": "node[1-2]",
            },
            "SLURM_NTASKS is not",
        ),
        (
            {
                "SLURM_PROCID": "2",
                "SLURM_NTASKS": "2",
                "SLURM_STEP_ID": "0",
                "SLURM_JOB_ID": "7",
                "SLURM_NODEID": "0",
                "SLURM_STEP_NODELIST": "node[1-2]",
            },
            "SLURM_PROCID=2 is not a rank",
        ),
        (
            {
                "SLURM_PROCID": "1",
                "SLURM_NTASKS": "2",
                "SLURM_STEP_ID": "0",
                "SLURM_JOB_ID": "7",
                "SLURM_NODEID": "0",
                "SLURM_STEP_NODELIST": "node[1-2",
            },
            "malformed Slurm node list",
        ),
    ):
        result = procs.train([], timeout=120, cwd=str(tmp_path), env=dict(environ, **broken))
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr)
        assert needle in lines[0] and "Traceback" not in result.stdout + result.stderr, lines[0]
    assert not (tmp_path / "runs").exists()  # nothing written


@pytest.mark.timeout(120)
def test_the_warning_while_a_rank_starts_stops_the_job_after_its_first_step(tmp_path):
    """SIGUSR1 (Slurm's warning: there is time left) does not end a rank that is still starting."""
    ranks = procs.start_ranks(2, [*TRAINING, "--resume"], cwd=str(tmp_path))
    try:
        line = ranks[0].stdout.readline()  # printed after the signals are handled, before training begins
        assert line.startswith("no checkpoint at runs/checkpoint.pt; starting afresh"), line
        os.kill(ranks[0].pid, signal.SIGUSR1)
        results = procs.wait_all(ranks, timeout=90)
    finally:
        for rank in ranks:
            procs.kill_group(rank)
    for rank, (code, _, err) in enumerate(results):
        assert code == 3, (rank, code, err)
        assert re.fullmatch(
            rf"train\.py: rank {rank}: stopped after epoch 1, step 1/150 \(SIGUSR1 to rank 0\); "
            r"checkpoint saved to runs/checkpoint\.pt; to resume: .*",
            err.strip(),
        ), err
    assert checkpoint_position(tmp_path / "runs" / "checkpoint.pt") == (1, 1)
