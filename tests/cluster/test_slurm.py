"""train.py under a real Slurm (tests/support/slurm_cluster.py: slurmctld, two slurmd on emulated nodes):
sbatch of the shipped scripts/slurm.sbatch trains on two nodes with no rank flags; a time limit's
SIGUSR1 stops it with a checkpoint, rank 0 requeues it, and the requeued job finishes bit for bit
as the uninterrupted one; scancel leaves a whole checkpoint; a finished job is not requeued.

Needs root and slurmctld, slurmd, slurm-client and munge (.ci/run installs them); in CI their absence is a failure.
"""

import math
import os
import re
import shlex
import signal
import sys
import time

import procs
import pytest
from procs import checkpoint_position, final_digest, wait_for
from slurm_cluster import FAST_REQUEUE, TIME_LIMIT_PERIOD, SlurmCluster, require_slurm

SCRIPT = os.path.join(procs.REPO, "scripts", "slurm.sbatch")
# About 8 s of training on two emulated nodes (the machine's two cores), 98% on the test subset.
TRAINING = ["--train-subset", "9600", "--test-subset", "1000", "--epochs", "2", "--save-every", "20"]
WARNING_AFTER = 7  # seconds from the time-limited job's start to Slurm's warning: past start-up, mid-training
# One thread a rank (OMP_NUM_THREADS from --cpus-per-task): the thread count changes the bits.
SBATCH = ["--cpus-per-task=1"]
JOB_ENV = {"PYTHON": sys.executable, "TRAIN_PY": procs.TRAIN}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_slurm()
    with SlurmCluster(nodes=2, workdir=tmp_path_factory.mktemp("slurm"), **FAST_REQUEUE) as c:
        yield c


def submit(cluster, folder, *options, args=(), env=JOB_ENV):
    return cluster.sbatch(SCRIPT, *SBATCH, *options, script_args=[*TRAINING, *args], cwd=folder, env=env)


def log_of(folder, job):
    path = folder / f"slurm-{job}.out"
    return path.read_text() if path.exists() else ""


def finished(cluster, folder, job, timeout):
    info = cluster.wait_job(job, timeout=timeout)
    return info, log_of(folder, job)


@pytest.fixture(scope="module")
def time_limited_job(cluster, tmp_path_factory):
    """A job with a one-minute limit, warned 60 s before it (--signal=USR1@60), so at slurmctld's first
    look at time limits after its start. slurmctld looks every 30 s; the job is held (--begin) until
    WARNING_AFTER s before a look, so the warning comes mid-training. Submitted before the
    uninterrupted job, which trains while this one waits. Returns (job id, its folder)."""
    folder = tmp_path_factory.mktemp("time-limited")
    begin = cluster.next_time_limit_check() - WARNING_AFTER
    if begin < time.time() + 2:
        begin += TIME_LIMIT_PERIOD
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(math.ceil(begin)))
    return submit(cluster, folder, "--time=1", "--signal=USR1@60", f"--begin={start}"), folder


@pytest.fixture(scope="module")
def straight(cluster, time_limited_job, tmp_path_factory):
    """The shipped script, uninterrupted, on both nodes: (its final sha256, its log, job id, folder)."""
    folder = tmp_path_factory.mktemp("straight")
    job = submit(cluster, folder)
    info, log = finished(cluster, folder, job, timeout=240)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), (info, log)
    return final_digest(log), log, job, folder


@pytest.mark.timeout(300)
def test_the_shipped_script_trains_on_two_nodes_without_rank_flags(straight):
    _, log, job, _ = straight
    assert f"Slurm job {job} step 0: 2 tasks on 2 nodes (node1, node2)" in log, log
    assert "2 hosts × 1 rank" in log, log  # Slurm's node ids: one rank on each node
    accuracies = [float(a) for a in re.findall(r"epoch \d/2 .* test accuracy ([\d.]+)%", log)]
    assert len(accuracies) == 2 and accuracies[-1] > 95.0, log  # 98.0% here
    assert "parameters identical on all 2 ranks" in log
    assert "Traceback" not in log and "error" not in log.lower(), log


@pytest.mark.timeout(400)
def test_a_time_limit_stops_checkpoints_requeues_and_the_job_ends_as_the_uninterrupted_one(
    cluster, straight, time_limited_job
):
    job, folder = time_limited_job
    info, log = finished(cluster, folder, job, timeout=360)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (info, log)
    restarts = int(info["Restarts"])
    assert restarts >= 1, log
    assert len(stop_lines(log, "SIGUSR1")) == 2 * restarts, log  # both ranks, each time
    assert (
        log.count(
            f"train.py: rank 0: requeued Slurm job {job}: when it runs again it continues from runs/checkpoint.pt"
        )
        == restarts
    ), log
    assert f"Slurm job {job} step 0: 2 tasks on 2 nodes (node1, node2), requeued {restarts} time" in log, log
    assert len(re.findall(r"resuming from runs/checkpoint\.pt: epoch \d, after step \d+", log)) == restarts, log
    assert final_digest(log.rsplit("resuming from", 1)[1]) == straight[0]
    assert "Traceback" not in log, log


def stop_lines(log, signal_name):
    """(rank, epoch, step) of every rank's stop line for `signal_name`. Slurm signals every task, but
    each on its own node: a rank whose signal lands a step later is not yet among the ranks named."""
    return re.findall(
        rf"train\.py: rank (\d): stopped after epoch (\d), step (\d+)/\d+ \({signal_name} to ranks? "
        rf"[\d, ]+\); checkpoint saved to runs/checkpoint\.pt",
        log,
    )


def stopped_at(log, signal_name, checkpoint):
    """Both ranks said they stopped on `signal_name` at one step, and the checkpoint loads, at that step."""
    stops = stop_lines(log, signal_name)
    assert sorted(rank for rank, _, _ in stops) == ["0", "1"], log
    assert len({(epoch, step) for _, epoch, step in stops}) == 1, log
    position = (int(stops[0][1]), int(stops[0][2]))
    assert checkpoint_position(checkpoint) == position, log
    return position


def wait_past(cluster, job, checkpoint, before):
    def moved():
        assert cluster.job_state(job)["JobState"] in ("PENDING", "RUNNING"), cluster.job_state(job)
        return (checkpoint_position(checkpoint) or (0, 0)) > before

    wait_for(moved, 120, "a checkpoint beyond " + str(before))


@pytest.mark.timeout(300)
def test_without_requeue_the_warning_stops_and_scancel_stops_with_a_whole_checkpoint(cluster, tmp_path):
    checkpoint = tmp_path / "runs" / "checkpoint.pt"
    # --no-requeue: Slurm's warning (sent by hand here, as the time limit sends it) stops the job, unrequeued
    job = submit(cluster, tmp_path, "--no-requeue")
    wait_past(cluster, job, checkpoint, (0, 0))
    assert cluster.run(["scancel", "--signal=USR1", str(job)]).returncode == 0
    info, log = finished(cluster, tmp_path, job, timeout=120)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "3:0", "0"), (info, log)
    first = stopped_at(log, "SIGUSR1", checkpoint)
    assert f"train.py: rank 0: not requeued: Slurm job {job} may not be requeued (sbatch --requeue allows it)" in log
    # submitted again it resumes; scancel (SIGTERM to every task) stops it, saved, and it is not requeued
    job = submit(cluster, tmp_path)
    wait_past(cluster, job, checkpoint, first)
    assert cluster.run(["scancel", str(job)]).returncode == 0
    info, log = finished(cluster, tmp_path, job, timeout=120)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), (info, log)
    assert f"resuming from runs/checkpoint.pt: epoch {first[0]}, after step {first[1]}" in log, log
    assert stopped_at(log, "SIGTERM", checkpoint) > first
    assert "requeued" not in log and "Traceback" not in log, log


# A task that starts slowly (a loaded node): it notes that it began, and what was pending when Python starts.
SLOW_START = f"""#!/bin/bash
echo > "began.$SLURM_PROCID"
sleep 3
grep ShdPnd /proc/$$/status > "pending.$SLURM_PROCID"
exec {shlex.quote(sys.executable)} "$@"
"""


@pytest.mark.timeout(300)
def test_a_finished_run_warned_as_it_starts_does_nothing_and_is_not_requeued(cluster, straight, tmp_path):
    """Slurm's warning before Python handles it (a --time shorter than the warning, a slow start) does
    not end a task: the script starts them with SIGUSR1 blocked, and train.py takes it once it can."""
    _, _, _, folder = straight
    checkpoint = (folder / "runs" / "checkpoint.pt").read_bytes()
    (tmp_path / "slow-python").write_text(SLOW_START)
    (tmp_path / "slow-python").chmod(0o755)
    job = submit(cluster, folder, env={**JOB_ENV, "PYTHON": str(tmp_path / "slow-python")})
    wait_for(lambda: all((folder / f"began.{rank}").exists() for rank in (0, 1)), 60, "both tasks to begin")
    assert cluster.run(["scancel", "--signal=USR1", str(job)]).returncode == 0
    info, log = finished(cluster, folder, job, timeout=60)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), (info, log)
    for rank in (0, 1):  # the warning came before Python started
        pending = int((folder / f"pending.{rank}").read_text().split()[1], 16)
        assert pending & 1 << (signal.SIGUSR1 - 1), (rank, hex(pending))
    assert "runs/checkpoint.pt is a finished run (2 of 2 epochs); nothing to do" in log, log
    assert (folder / "runs" / "checkpoint.pt").read_bytes() == checkpoint


@pytest.mark.timeout(300)
def test_two_tasks_a_node_sum_hierarchically_and_srun_torchrun_still_works(cluster, tmp_path):
    short = ["--epochs", "1", "--train-subset", "1280", "--test-subset", "500", "--metrics", ""]
    job = submit(cluster, tmp_path, "--ntasks-per-node=2", args=[*short, "--allreduce", "hierarchical"])
    torchrun = tmp_path / "torchrun.sbatch"  # one torchrun agent a node; torchrun's RANK wins over Slurm's
    torchrun.write_text(
        f"#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1 --cpus-per-task=1\n"
        f"export OMP_NUM_THREADS=1\nsrun {sys.executable} -m torch.distributed.run --nnodes 2 "
        f"--nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint node1:29400 --rdzv-id t "
        f"{procs.TRAIN} {shlex.join(short)} --checkpoint t.pt --save-path t.pth\n"
    )
    torchrun_job = cluster.sbatch(torchrun, cwd=tmp_path)
    info, log = finished(cluster, tmp_path, job, timeout=240)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (info, log)
    assert f"Slurm job {job} step 0: 4 tasks on 2 nodes (node1, node2)" in log, log
    assert "all-reduce hierarchical" in log and "2 hosts × 2 ranks" in log, log  # node ids from Slurm
    assert "parameters identical on all 4 ranks" in log, log
    info, log = finished(cluster, tmp_path, torchrun_job, timeout=240)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (info, log)
    assert "rank 0 of 2:" in log and "2 hosts × 1 rank" in log and "Slurm job" not in log, log
    assert "parameters identical on all 2 ranks" in log, log
