"""One output folder, one job: rank 0 locks its outputs; a finished run resumes to nothing."""

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import procs
import pytest
import torch
from checkpoint_watch import Watch
from procs import checkpoint_position, wait_for

from utils.errors import UsageError
from utils.learn.model import Net, parameter_vector
from utils.setup.config import Outputs
from utils.store.outputs import lock_outputs

HOST = socket.gethostname()


def start(args, cwd):
    """The local launcher in its own process group, not waited for."""
    return procs.popen(
        [sys.executable, procs.TRAIN, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def read(path):
    try:
        return open(path).read().strip()
    except OSError:
        return None


def snapshot(folder):
    """Every file in `folder`: name -> (mtime, sha256)."""
    return {
        name: (os.stat(folder / name).st_mtime_ns, hashlib.sha256((folder / name).read_bytes()).hexdigest())
        for name in sorted(os.listdir(folder))
    }


def assert_refused(result, path, pid):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in (path, f"pid {pid} on {HOST}", "--save-path", "--checkpoint", "--metrics"):
        assert needle in lines[0], lines[0]


def holder_script(folder):
    """A process that locks the outputs named `folder`/x.* and waits to be killed."""
    return [
        sys.executable,
        "-c",
        "import sys, time\n"
        "from utils.setup.config import Outputs\nfrom utils.store.outputs import lock_outputs\n"
        f"lock_outputs(Outputs(checkpoint={str(folder / 'x.pt')!r}, save_path={str(folder / 'x.pth')!r}, "
        f"metrics={str(folder / 'x.jsonl')!r}))\nprint('locked', flush=True)\ntime.sleep(120)",
    ]


@pytest.mark.timeout(60)
def test_the_lock_refuses_a_second_process_and_dies_with_its_holder(tmp_path):
    outputs = Outputs(
        checkpoint=str(tmp_path / "x.pt"), save_path=str(tmp_path / "x.pth"), metrics=str(tmp_path / "x.jsonl")
    )
    lock_outputs(outputs, hold=False)  # nobody holds them; a look creates no file
    assert not list(tmp_path.iterdir())
    holder = procs.popen(holder_script(tmp_path), stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for hold in (False, True):
            with pytest.raises(
                UsageError,
                match=rf"--checkpoint {re.escape(outputs.checkpoint)} is in use by "
                rf"another job \(pid {holder.pid} on {re.escape(HOST)}\)",
            ):
                lock_outputs(outputs, hold=hold)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        procs.kill_group(holder)
    lock_outputs(outputs, hold=False)  # free again: the kernel dropped the dead holder's locks
    again = procs.popen(holder_script(tmp_path), stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert again.stdout.readline().strip() == "locked"
        assert read(tmp_path / "x.pt.lock") == f"pid {again.pid} on {HOST}"
    finally:
        procs.kill_group(again)
        again.wait()


@pytest.mark.timeout(300)
def test_a_second_job_on_the_same_outputs_stops_and_the_first_is_not_disturbed(tmp_path):
    # 200 steps: the first job is still training when both refusals (one imports torch) are done
    args = ["--epochs", "2", "--test-subset", "200", "--train-subset", "6400"]
    first = start(args, str(tmp_path))
    try:  # the lock names the job: the launcher's pid, written by its rank 0
        wait_for(
            lambda: read(tmp_path / "runs" / "checkpoint.pt.lock") == f"pid {first.pid} on {HOST}",
            120,
            "the first job's rank 0 to take the lock",
        )
        for mode in (
            [],
            [
                "--rank",
                "0",
                "--world-size",
                "2",
                "--init-method",
                f"tcp://127.0.0.1:{procs.free_port()}",
                "--timeout",
                "100",
            ],
        ):  # the local launcher, and a rank 0 started by hand
            started = time.time()
            second = procs.train([*args, "--seed", "2", *mode], timeout=60, cwd=str(tmp_path))
            assert_refused(second, os.path.join("runs", "checkpoint.pt"), first.pid)
            assert time.time() - started < 30  # before rendezvous: it waited for nobody
        assert first.poll() is None, "the first job stopped while the second one was refused"
        out, err = first.communicate(timeout=240)
    finally:
        procs.kill_group(first)
    assert first.returncode == 0, err
    runs = tmp_path / "runs"
    rows = [json.loads(line) for line in (runs / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [1, 2]
    assert checkpoint_position(runs / "checkpoint.pt") == (3, 0)
    assert not (runs / "checkpoint.pt.prev").exists()  # nobody set the first job's checkpoint aside
    model = Net()
    model.load_state_dict(torch.load(runs / "model_state_dict.pth", weights_only=True))
    flat = parameter_vector(model)
    assert re.search(r"sha256 ([0-9a-f]{64})", out).group(1) == hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def kill_mid_epoch(job, checkpoint, past, whole, lock=None):
    """Once `job` has saved a checkpoint of epoch 1 beyond `past` (and, given `lock`, holds that
    lock file), SIGKILL it: its whole process group, or the launcher alone (its ranks then get
    SIGTERM from the kernel: PR_SET_PDEATHSIG). Returns its stdout and the position it was killed after."""
    watch, held = Watch(checkpoint), lock is None

    def ready():
        nonlocal held
        assert job.poll() is None, job.communicate()
        held = held or read(lock) == f"pid {job.pid} on {HOST}"  # the lock names the job: the launcher
        return held and (watch.position() or (0, 0)) > past and watch.position()[0] == 1

    try:
        wait_for(ready, 120, "a mid-epoch checkpoint")
        if whole:
            os.killpg(job.pid, signal.SIGKILL)
        else:
            job.kill()
        out, _ = job.communicate(timeout=30)
    finally:
        procs.kill_group(job)
    return out, watch.position()


@pytest.mark.timeout(300)
def test_a_killed_job_leaves_no_lock_behind(tmp_path):
    """A job killed whole, then the one resuming it killed by its launcher alone: each time the next
    job on the same outputs takes the lock and trains."""
    args = ["--epochs", "1", "--test-subset", "200", "--train-subset", "3200", "--save-every", "2", "--metrics", ""]
    checkpoint, lock = tmp_path / "runs" / "checkpoint.pt", tmp_path / "runs" / "checkpoint.pt.lock"
    _, killed_at = kill_mid_epoch(start(args, str(tmp_path)), checkpoint, (0, 0), whole=True)
    out, _ = kill_mid_epoch(start([*args, "--resume"], str(tmp_path)), checkpoint, killed_at, whole=False, lock=lock)
    assert f"resuming from runs/checkpoint.pt: epoch 1, after step {killed_at[1]}" in out, out
    result = procs.train(args, timeout=200, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "resuming from" not in result.stdout, result.stdout


@pytest.mark.timeout(300)
def test_jobs_with_their_own_outputs_run_side_by_side(tmp_path):
    common = ["--epochs", "1", "--test-subset", "200", "--train-subset", "1280"]
    other = ["--save-path", "runs/b.pth", "--checkpoint", "runs/b.pt", "--metrics", "runs/b.jsonl"]
    jobs = [start(common, str(tmp_path)), start([*common, "--seed", "2", *other], str(tmp_path))]
    results = procs.wait_all(jobs, timeout=240)
    assert [code for code, _, _ in results] == [0, 0], [err for _, _, err in results]
    runs = tmp_path / "runs"
    for model, metrics in (("model_state_dict.pth", "metrics.jsonl"), ("b.pth", "b.jsonl")):
        assert len((runs / metrics).read_text().splitlines()) == 1
        torch.load(runs / model, weights_only=True)
    assert checkpoint_position(runs / "checkpoint.pt") == checkpoint_position(runs / "b.pt") == (2, 0)


@pytest.mark.timeout(300)
def test_resuming_a_finished_run_does_nothing(tmp_path):
    run = tmp_path / "run"
    args = [
        "--epochs",
        "1",
        "--test-subset",
        "200",
        "--train-subset",
        "640",
        "--checkpoint",
        str(run / "c.pt"),
        "--save-path",
        str(run / "m.pth"),
        "--metrics",
        str(run / "metrics.jsonl"),
    ]
    assert procs.train(args, timeout=200).returncode == 0
    before = snapshot(run)
    line = f"{run / 'c.pt'} is a finished run (1 of 1 epochs); nothing to do"
    result = procs.train([*args, "--resume"], timeout=100)  # the local launcher: it decides alone
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, line, ""), result
    assert snapshot(run) == before
    ranks = procs.start_ranks(2, [*args, "--resume", "--timeout", "60"])  # rank 0 tells rank 1
    results = procs.wait_all(ranks, timeout=100)
    assert results == [(0, line + "\n", ""), (0, "", "")], results
    assert snapshot(run) == before
