"""train.py --stop against a live job of 2 ranks on loopback: a wrong key stops nothing (exit 2, the
members count what they dropped, the job goes on); the job's key stops every rank after the same
step, saved, exit 3 with the resume command (the ranks' lines name the --stop)."""

import json
import os
import re
import subprocess
import sys

import procs
import pytest
from procs import checkpoint_position

ARGS = ["--epochs", "2", "--test-subset", "100", "--timeout", "30", "--metrics", ""]  # (938 steps an epoch)


def steps_done(port, cwd):
    """The job's steps done so far by --status's answering member, or None before its first."""
    result = procs.train(["--status", f"127.0.0.1:{port}", "--json"], timeout=30, cwd=str(cwd))
    if result.returncode != 0:
        return None
    progress = json.loads(result.stdout)["members"][0]
    return None if progress["step"] is None else (progress["epoch"], progress["step"])


def wrong_key_stop(port, cwd):
    """--stop with another key, in a process of its own that says whether it loaded torch."""
    (cwd / "wrong.key").write_text("f" * 64)
    os.chmod(cwd / "wrong.key", 0o600)
    probe = (
        "import sys, train; "
        f"code = train.main(['--stop', '127.0.0.1:{port}', '--key-file', 'wrong.key']); "
        "print(code, 'torch' in sys.modules)"
    )
    env = dict(os.environ, PYTHONPATH=procs.REPO)
    return subprocess.run(
        [sys.executable, "-c", probe], cwd=str(cwd), env=env, capture_output=True, text=True, timeout=30
    )


@pytest.mark.timeout(180)
def test_a_wrong_key_stops_nothing_and_the_right_one_stops_every_rank_after_one_step(tmp_path):
    both = procs.train(["--status", "--stop"], timeout=30, cwd=str(tmp_path))
    assert both.returncode == 2 and both.stderr.count("\n") == 1 and "not allowed with" in both.stderr, both.stderr
    port = procs.free_port()
    ranks = procs.start_ranks(2, ARGS, port, str(tmp_path))
    try:
        procs.wait_for(lambda: steps_done(port, tmp_path) is not None, 120, "the job's first step")
        wrong = wrong_key_stop(port, tmp_path)
        assert wrong.stdout.split() == ["2", "False"] and wrong.stderr.count("\n") == 1, (wrong.stdout, wrong.stderr)
        assert f"no job took the stop at 127.0.0.1:{port} within 5 s with the key from --key-file wrong.key" in (
            wrong.stderr
        )
        before = steps_done(port, tmp_path)
        procs.wait_for(lambda: (steps_done(port, tmp_path) or (0, 0)) > before, 30, "the job going on")
        assert all(r.poll() is None for r in ranks)

        stopped = procs.train(["--stop", f"127.0.0.1:{port}"], timeout=30, cwd=str(tmp_path))  # the key beside runs/
        assert stopped.returncode == 0 and stopped.stdout.count("\n") == 1, (stopped.stdout, stopped.stderr)
        taker = re.match(r"rank (\d) of the job \(127\.0\.0\.1:\d+\) took the stop: every rank stops", stopped.stdout)
        assert taker, stopped.stdout
        results = procs.wait_all(ranks, timeout=60)
    finally:
        for r in ranks:
            procs.kill_group(r)
    assert [code for code, _, _ in results] == [3, 3], [err for _, _, err in results]
    where = set()
    for rank, (_, out, err) in enumerate(results):
        line = re.fullmatch(
            rf"train\.py: rank {rank}: stopped after epoch (\d), step (\d+)/938 \(train\.py --stop from "
            rf"127\.0\.0\.1 to rank {taker[1]}\); checkpoint saved to runs/checkpoint\.pt; to resume: "
            r"python3 -u train\.py .* --resume",
            err.strip().splitlines()[-1],
        )
        assert line, err
        where.add((int(line[1]), int(line[2])))
        assert re.search(rf"rank {rank}: dropped \d+ control datagrams that failed a check \(\d+ signature\)", out), out
    assert len(where) == 1 and checkpoint_position(tmp_path / "runs" / "checkpoint.pt") == where.pop()
