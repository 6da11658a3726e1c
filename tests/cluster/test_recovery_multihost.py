"""A cut link between emulated servers (scripts/netns.py): no reset, only silence. The side with
the majority goes on; the server cut off alone must stop, with its last step saved on its own disk
(each host runs in a folder of its own, as on its own server), and never train on by itself."""

import json
import re
import time

import cluster  # noqa: F401  (scripts/, on the path through tests/conftest.py)
import pytest
from forker import popen
from hosts import NICS, remember, report, start_ranks, wait_ranks
from procs import checkpoint_position

pytestmark = pytest.mark.usefixtures("needs_root")  # tests/conftest.py

RUN = [
    "--epochs",
    "1",
    "--train-subset",
    "6400",
    "--test-subset",
    "200",
    "--timeout",
    "60",
    "--heartbeat",
    "2",
    "--save-every",
    "5",
    "--rejoin-timeout",
    "0",  # it exits at once (waiting for the cable and joining again: tests/cluster/test_heal_cut.py)
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", [0, 2], ids=["rank0-cut-off", "last-rank-cut-off"])
def test_a_server_cut_off_stops_alone_and_the_majority_goes_on(victim, tmp_path):
    with remember(cluster.Cluster(3, nics=NICS, starter=popen)) as c:
        procs = start_ranks(c, [c.train_argv(r, 29500, RUN) for r in range(3)], tmp_path)
        home = tmp_path / "host0" / "runs" / "checkpoint.pt"
        deadline = time.monotonic() + 120
        while checkpoint_position(home) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        c.link_down(victim)
        results = wait_ranks(c, procs, tmp_path, timeout=150)
    survivors = [r for r in range(3) if r != victim]
    assert [results[r][0] for r in survivors] == [0, 0], report(results)
    code, out, err, seconds = results[victim]
    assert code == 1, report(results)
    assert re.search(
        rf"only rank {victim} of 3 is reachable \((rank \d: silent [\d.]+ s(; )?){{2}}\): not a "
        rf"majority, so this side stops",
        err,
    ), report(results)
    saved = re.search(r"saved the checkpoint of epoch 1, step (\d+) to runs/checkpoint.pt", err)
    assert saved, err
    assert checkpoint_position(tmp_path / f"host{victim}" / "runs" / "checkpoint.pt") == (1, int(saved.group(1)))
    assert seconds < 60, report(results)  # it noticed within a heartbeat or so, and did not train on alone
    writer = survivors[0]  # the lowest survivor: rank 0 of the new generation, evaluates and writes
    lines = results[writer][1]
    assert (
        f"rank {writer}: lost rank {victim} at epoch 1" in lines
        and "was silent for 2 s" in results[0][1] + results[1][1] + results[2][1]
    ), report(results)
    assert "parameters identical on all 2 ranks" in lines, report(results)
    metrics = json.loads((tmp_path / f"host{writer}" / "runs" / "metrics.jsonl").read_text())
    assert metrics["images"] == 6400 and metrics["members"] == survivors
    assert checkpoint_position(tmp_path / f"host{writer}" / "runs" / "checkpoint.pt") == (2, 0)  # the finished run
