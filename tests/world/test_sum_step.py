"""A bucket's sum (and the all-reduce in it) is drawn in the step whose gradient it sums, however late its thread starts
(tests/support/sum_step_worker.py: one rank over real gloo)."""

import json
import os
import subprocess
import sys

from utils.setup.launch import free_port

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")


def test_a_sum_whose_thread_starts_in_the_next_step_is_drawn_in_its_own(tmp_path):
    worker = [sys.executable, os.path.join(HERE, "sum_step_worker.py"), str(free_port()), str(tmp_path / "t.json")]
    done = subprocess.run(
        worker, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert done.returncode == 0, done.stderr
    drawn = json.loads(done.stdout.splitlines()[-1])
    buckets = len(drawn["sum"])
    assert buckets > 2  # one sum a bucket (0.05 MB buckets)
    assert drawn["sum"] == drawn["all-reduce"] == [1] * buckets  # not 2: the step under way when a thread began
