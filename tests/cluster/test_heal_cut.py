"""A cut cable that comes back (emulated servers, scripts/netns.py): the server cut off alone has no
majority, so it saves and stops training, waits for the job (--rejoin-timeout), and once its link is
up again joins the majority's job at its next step, with the current model. The majority never stops."""

import re
import time

import cluster  # noqa: F401  (scripts/, on the path through tests/conftest.py)
import pytest
from forker import popen
from hosts import ENV, NICS, remember, report, start_ranks, wait_ranks
from procs import checkpoint_position

from utils.observe.instruments import environ_for, read_events

pytestmark = pytest.mark.usefixtures("needs_root")  # tests/conftest.py

RUN = [
    "--epochs",
    "1",
    "--train-subset",
    "25600",
    "--test-subset",
    "200",
    "--timeout",
    "60",
    "--heartbeat",
    "2",
    "--save-every",
    "50",
]
CUT_SECONDS = 12
# seconds every rank sleeps as a step begins (RING_INSTRUMENTS's pace): 400 steps outlast the cut and the return
# (350 steps after step 50 take at least 26 s on the fastest machine), at a fifth of the CPU of 2 epochs of 60,000
PACE = 0.07


@pytest.mark.timeout(400)
def test_a_server_cut_off_waits_for_the_cable_and_joins_the_job_again(tmp_path):
    with remember(cluster.Cluster(3, nics=NICS, starter=popen)) as c:
        events = tmp_path / "events.jsonl"
        env = dict(ENV, **environ_for(events=str(events), pace=PACE))
        procs = start_ranks(c, [c.train_argv(r, 29500, RUN) for r in range(3)], tmp_path, env=env)
        home = tmp_path / "host0" / "runs" / "checkpoint.pt"
        deadline = time.monotonic() + 120
        while checkpoint_position(home) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1)  # well into training (step 50 is saved)
        c.link_down(2)
        time.sleep(CUT_SECONDS)
        c.link_up(2)
        restored = time.time()
        results = wait_ranks(c, procs, tmp_path, timeout=300)
    assert [code for code, _, _, _ in results] == [0, 0, 0], report(results)
    out0, err2, out2 = results[0][1], results[2][2], results[2][1]
    assert re.search(r"only rank 2 of 3 is reachable .*not a majority, so this side stops", err2), report(results)
    assert "waiting up to 300 s to join the job again" in err2, report(results)
    assert "lost rank 2 at epoch" in out0, report(results)
    joined = re.search(r"rank \d+: joined the job after epoch \d, step \d+, .*; back after ([\d.]+) s out$", out2, re.M)
    assert joined, report(results)
    came = re.search(r"rank (\d+) comes back after [\d.]+ s out, \d+ steps? missed", out0)
    assert came, report(results)
    first = [e for e in read_events(events) if e["event"] == "first-step" and e["after"] == "joined"]
    assert len(first) == 1 and first[0]["time"] - restored < 10, (first, restored)  # back within 10 s of the cable
    assert "parameters identical on all 3 ranks" in out0, report(results)
