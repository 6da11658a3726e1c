"""--sync-every H: H inner steps on each rank, then the parameters' change averaged behind the
next round (utils/sync/periodic.py). Real processes, our own rings."""

import json
import os
import re
import shutil

import procs
import pytest
from procs import final_digest

from utils.observe.instruments import environ_for

SHORT = ["--epochs", "1", "--train-subset", "3200", "--test-subset", "1000", "--timeout", "60"]  # 50 steps
FP16 = ["--compress", "fp16"]


def test_bad_values_are_one_line_and_exit_2():
    for args in (
        ["--sync-every", "0"],
        ["--sync-every", "4", "--outer", "nesterov", "--outer-lr", "nan"],
        ["--outer", "nesterov"],
        ["--sync-every", "4", "--outer-lr", "0.5"],
        ["--sync-every", "4", "--outer", "nesterov", "--outer-momentum", "1"],
        ["--sync-every", "4", "--compress", "powersgd"],
        ["--sync-every", "4", "--lazy-update"],
        ["--merge-after", "2"],
        ["--sync-every", "8", "--merge-after", "9"],
        ["--sync-every", "8", "--merge-after", "0"],
    ):
        result = procs.train(args, timeout=30)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, (args, result.stderr)
        assert result.stderr.startswith("train.py: error: "), (args, result.stderr)


def h8_run(outer, folder, *more):
    """SHORT with --sync-every 8, --outer `outer` and `more`, its metrics and a timeline written in `folder`."""
    result = procs.train(
        [*SHORT, "--sync-every", "8", "--outer", outer, *more, "--metrics", "m.jsonl", "--timeline", "trace.json"],
        cwd=str(folder),
    )
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def h8_nesterov(tmp_path_factory):
    """The uninterrupted nesterov run (fp16 on the wire): test_h8_trains_sends_an_eighth_and_ends_identical[nesterov]
    reads it, and test_a_stop_mid_round_resumes_bit_for_bit's resumed job must end with its bits. (Made once; its
    metrics and timeline are only written beside the run, they change none of its numbers.)"""
    folder = tmp_path_factory.mktemp("h8-nesterov")
    return h8_run("nesterov", folder, *FP16), folder


@pytest.mark.timeout(300)
@pytest.mark.parametrize("outer", ["average", "nesterov"])
def test_h8_trains_sends_an_eighth_and_ends_identical(outer, tmp_path, request):
    if outer == "nesterov":
        result, folder = request.getfixturevalue("h8_nesterov")
    else:
        result, folder = h8_run(outer, tmp_path), tmp_path
    assert "parameters identical on all 2 ranks" in result.stdout
    row = json.loads((folder / "m.jsonl").read_text().splitlines()[-1])
    assert row["test_accuracy"] > 0.80, row  # it trains (10% is chance); accuracy targets: the benchmark
    # the timeline: each rank's outer sums as spans, on their own row, beside the inner steps
    trace = json.loads((folder / "trace.json").read_text())["traceEvents"]
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    for rank in (0, 1):
        sums = [e for e in trace if e["ph"] == "X" and e["pid"] == rank and e["name"] == "outer-sum"]
        steps = [e for e in trace if e["ph"] == "X" and e["pid"] == rank and e["name"] == "optimizer"]
        assert len(sums) >= 3 and len(steps) >= 20, (rank, len(sums), len(steps))  # (the window: its last 30 steps)
        assert {rows[rank, e["tid"]] for e in sums}.isdisjoint({rows[rank, e["tid"]] for e in steps}), rows
    if outer != "average":
        return
    # the float32 change (421,642 values + the flag) every 8 steps, two-pass: each rank sends it
    # about once a round; the per-step sum sends as much every step (the same every step: 10 of them tell)
    per_step = procs.train([*SHORT, "--train-subset", "640", "--metrics", "m1.jsonl"], cwd=str(tmp_path))
    assert per_step.returncode == 0, per_step.stderr
    every_step = json.loads((tmp_path / "m1.jsonl").read_text().splitlines()[-1])["bytes_sent_per_step"]
    assert row["bytes_sent_per_step"] < every_step / 8 * 1.2, (row["bytes_sent_per_step"], every_step)


@pytest.mark.timeout(400)
def test_a_stop_mid_round_resumes_bit_for_bit(h8_nesterov, tmp_path):
    """SIGTERM reaches every rank with an outer sum (the one started at step 24, merged 4 steps
    later); the checkpoint holds each rank's own state (its working parameters, its Adam, the
    anchor, the momentum, fp16's scale), so the resumed job ends with the bits of the job that never
    stopped. A copy of the stopped job's folder: a resume with another H is refused; then it goes on
    on 3 ranks, where every rank takes rank 0's state (its working parameters, Adam, the anchor and
    the mean that arrived): the job goes on from one model, and ends on one."""
    stopped_dir, resized_dir = tmp_path / "stopped", tmp_path / "resized"
    stopped_dir.mkdir()
    args = [*SHORT, "--sync-every", "8", "--outer", "nesterov", *FP16, "--metrics", "m.jsonl"]
    straight = h8_nesterov[0]  # the same run, which also wrote a timeline
    stopped = procs.train(args, cwd=str(stopped_dir), env=dict(os.environ, **environ_for(faults="0:21:TERM")))
    assert stopped.returncode == 3 and "stopped after epoch 1, step 28/50" in stopped.stderr, stopped.stderr
    shutil.copytree(stopped_dir, resized_dir)

    resumed = procs.train([*args, "--resume"], cwd=str(stopped_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert final_digest(resumed.stdout) == final_digest(straight.stdout)

    other_h = [*SHORT, "--sync-every", "4", "--outer", "nesterov", *FP16, "--metrics", "m.jsonl", "--resume"]
    result = procs.train(other_h, cwd=str(resized_dir), timeout=60)
    assert result.returncode == 2 and "--sync-every 8" in result.stderr and result.stderr.count("\n") == 1, (
        result.stderr
    )
    resumed = procs.train([*args, "--nproc", "3", "--resume"], cwd=str(resized_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming on 3 ranks; the checkpoint was made on 2" in resumed.stdout, resumed.stdout
    assert "parameters identical on all 3 ranks" in resumed.stdout
    row = json.loads((resized_dir / "m.jsonl").read_text().splitlines()[-1])
    assert row["images"] == 3200 and row["test_accuracy"] > 0.80, row


@pytest.mark.timeout(300)
def test_a_lost_rank_is_seen_at_a_rounds_end_and_the_others_go_on(tmp_path):
    """Between syncs nothing is summed, so a killed rank (as step 20 begins) is seen when the next
    sum is merged (step 28, for the round ending at step 24; or at step 20, if the round ending at
    step 16 was still being summed when it died, as on a loaded machine): that step counts as
    done, and the survivors go on from the last outer step."""
    result = procs.train(
        [*SHORT, "--nproc", "3", "--sync-every", "8", "--metrics", "m.jsonl"],
        cwd=str(tmp_path),
        env=dict(os.environ, **environ_for(faults="1:20:KILL")),
    )
    assert result.returncode == 0, result.stderr
    # the round ending at step 24 sums in the background; its failure, or the next one's, is seen at its merge
    assert re.search(r"continuing on 2 ranks from step (20|28|36) ", result.stdout), result.stdout
    assert "parameters identical on all 2 ranks" in result.stdout
    assert json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])["images"] == 3200
