"""utils/memory.py: with glibc's limits set, a rank whose batch changed size faults in no fresh
pages step after step (without them, 2,700-5,500 a step in most runs measured: bench/README.md).
The steps are bench/page_faults.py's run, in a process of its own."""

import json
import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "page_faults.py")


def test_a_step_after_its_batch_grew_reuses_the_memory_the_last_step_freed():
    # ":1": with the limits set; the run fails if mallopt did not take them
    run = [sys.executable, TOOL, "--run", "32 for 10 steps, then 56:1"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    _, faults = json.loads(out.stdout)
    # the first steps at 56 images grow the heap; after them a step's buffers are the last step's
    assert max(faults[-10:]) <= 16, faults
