"""What an epoch reports is the whole epoch's, whatever happened in it: after a change of members
mid-epoch, the epoch line, the progress lines and metrics.jsonl still give the epoch's time since
its first step and its traffic over every step (utils/learn/state.py keeps both with the position)."""

import json
import os
import re
import signal

import procs
import pytest

from utils.observe.instruments import environ_for, read_events

HEARTBEAT = 5  # seconds a frozen rank is silent before the others go on: the epoch lasts at least this
PARAMETERS = 421_642  # a 2-rank two-pass step sends every gradient once from each rank: 4 bytes each


@pytest.mark.timeout(300)
def test_a_change_of_members_mid_epoch_keeps_the_epoch_s_clock_and_traffic(tmp_path):
    args = ["--nproc", "3", "--epochs", "1", "--train-subset", "6400", "--test-subset", "200", "--timeout", "60"]
    args += ["--heartbeat", str(HEARTBEAT), "--metrics", "m.jsonl"]
    events = tmp_path / "events.jsonl"
    launcher = procs.popen(
        [procs.sys.executable, procs.TRAIN, *args],
        cwd=tmp_path,
        env=dict(os.environ, **environ_for(faults="2:13:STOP", events=str(events))),
        text=True,
        stdout=procs.subprocess.PIPE,
        stderr=procs.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        procs.wait_for(lambda: procs.stopped_rank(launcher, 2), 60, "rank 2 to stop itself")
        went_on = lambda: any(e.get("after") == "shrank" for e in read_events(str(events)))  # noqa: E731
        procs.wait_for(went_on, 60, "the others to go on without rank 2")
        os.kill(procs.stopped_rank(launcher, 2), signal.SIGCONT)  # it finds itself fenced out, and stops
        outcome = procs.supervise([launcher], timeout=180, poll=0.05)
    finally:
        procs.kill_group(launcher)
    out, err = outcome.outputs[0]
    assert not outcome.timed_out, err
    assert "lost rank 2 at epoch 1" in out, out
    seconds = float(re.search(r"epoch 1/1 .* time ([\d.]+) s", out).group(1))
    progress = [int(s) for s in re.findall(r"epoch 1: \d+/100 steps, mean loss [\d.]+, (\d+) s", out)]
    metrics = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert seconds >= HEARTBEAT and metrics["seconds"] >= HEARTBEAT, (seconds, metrics["seconds"])
    assert progress and progress == sorted(progress) and progress[-1] >= HEARTBEAT, out
    assert metrics["bytes_sent_per_step"] >= 4 * PARAMETERS, metrics  # every step's bytes, before the change too
    assert (
        re.search(r"sent (\d\.\d+) MB/step", out) and float(re.search(r"sent ([\d.]+) MB/step", out).group(1)) >= 1.68
    )


@pytest.mark.timeout(120)
def test_the_epoch_s_report_does_not_wait_for_the_gather_of_every_rank_s_state(tmp_path):
    """The epoch's line (and its time) comes after the few bytes that say nothing is non-finite, and
    before the checkpoint's copies of every rank's state cross the wire: --sync-every's are some
    10 MB a rank, seconds at 20 Mbit/s, which 11bd114 put inside the epoch's time."""
    worker = os.path.join(os.path.dirname(procs.TRAIN), "tests", "support", "epoch_end_worker.py")
    result = procs.subprocess.run(
        [procs.sys.executable, worker, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=100,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    said = json.loads(result.stdout.strip().splitlines()[-1])
    assert said["sync"] == "PeriodicSync"  # (a sum whose ranks keep state of their own: there is a gather)
    assert said["order"] == ["check_finite", "report", "gather"], said
