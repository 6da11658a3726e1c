"""The start-up handshake (utils/distributed.handshake, #32): ranks started with another world size,
or from another program, stop on both sides with one line and exit code 2 as soon as both have
spoken (not after --timeout), before anything trains or is written."""

import os
import re
import shutil
import subprocess
import sys
import time

import procs
from procs import REPO

TIMEOUT = 120  # --timeout: the ranks must not wait it out
SMALL = ["--train-subset", "640", "--test-subset", "100", "--metrics", ""]


def start(train, rank, world_size, port, folder, cwd=None):
    """One rank of `train` (a train.py) on loopback, its outputs in `folder`."""
    return procs.popen(
        [
            sys.executable,
            train,
            *["--rank", str(rank), "--world-size", str(world_size), "--init-method", f"tcp://127.0.0.1:{port}"],
            *["--gloo_socket_ifname", "lo", "--timeout", str(TIMEOUT), *SMALL],
            *["--data-dir", os.path.join(REPO, "data"), "--checkpoint", str(folder / "c.pt")],
            *["--save-path", str(folder / "m.pth")],
        ],
        cwd=cwd or folder,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def stopped_on_both_sides(ranks, folder, started):
    """Both ranks exit 2 with the same one line, well before --timeout; nothing written. The line."""
    results = procs.wait_all(ranks, timeout=TIMEOUT - 20)  # kills both on the way out
    assert time.time() - started < TIMEOUT / 2, "waited for --timeout"  # a hang check, not a speed target
    for code, out, err in results:
        assert code == 2, (code, out, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err + out, err
    assert results[0][2] == results[1][2], results
    assert list(folder.iterdir()) == []  # no checkpoint, no model, and rank 0's lock released
    return results[0][2].strip()


def test_ranks_with_different_world_sizes_stop_at_once(tmp_path):
    port, started = procs.free_port(), time.time()
    ranks = [start(procs.TRAIN, 0, 2, port, tmp_path), start(procs.TRAIN, 1, 3, port, tmp_path)]
    line = stopped_on_both_sides(ranks, tmp_path, started)
    assert line == "train.py: error: ranks were started with different --world-size: rank 0 has 2, rank 1 has 3"


def test_ranks_running_different_programs_stop_at_once(tmp_path):
    other = tmp_path / "other"  # the repository's program, one utils file changed by a comment
    other.mkdir()
    shutil.copy(procs.TRAIN, other / "train.py")
    shutil.copytree(os.path.join(REPO, "utils"), other / "utils", ignore=shutil.ignore_patterns("__pycache__"))
    with open(other / "utils" / "errors.py", "a") as f:
        f.write("# a comment: another program all the same\n")
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    port, started = procs.free_port(), time.time()
    ranks = [start(procs.TRAIN, 0, 2, port, outputs), start(str(other / "train.py"), 1, 2, port, outputs, cwd=other)]
    line = stopped_on_both_sides(ranks, outputs, started)
    match = re.fullmatch(
        r"train\.py: error: different program \(train\.py and utils/\): rank 0 has ([0-9a-f]{16}), "
        r"rank 1 has ([0-9a-f]{16})",
        line,
    )
    assert match and match.group(1) != match.group(2), line
    from utils.setup.program import program_digest

    assert (match.group(1), match.group(2)) == (program_digest(), program_digest(other))
