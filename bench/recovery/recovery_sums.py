"""Live recovery under every kind of gradient sum: a rank lost in the middle of a sum, and the job goes on.

    python bench/recovery/recovery_sums.py                      # every --allreduce x --compress, about 16 runs
    python bench/recovery/recovery_sums.py --only hierarchical  # the combinations whose name contains this

For each combination, `python train.py --nproc 3` (the local launcher, 30 steps) with RING_INSTRUMENTS
making rank 1 send itself SIGKILL during step 13's gradient sum (utils/observe/instruments.py). It must
go on with 2 ranks and finish with identical parameters on both; with PowerSGD, saying that the
lost rank's error feedback is dropped. tests/world/test_recovery.py runs one combination (hierarchical
with PowerSGD); this runs them all. Exit code 1 when any fails.
"""

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN = ["--nproc", "3", "--epochs", "1", "--train-subset", "1920", "--test-subset", "200", "--timeout", "60"]
FAULT = "1:13:KILL:sum"
DROPPED = "the lost ranks’ PowerSGD error feedback is dropped"


def combinations():
    """{name: extra train.py flags}."""
    return {
        f"{allreduce}/{compress}": [
            *("--allreduce", allreduce, "--compress", compress),
            *(["--powersgd-warmup", "2"] if compress == "powersgd" else []),
        ]
        for allreduce, compress in itertools.product(
            ("two-pass", "ring", "gloo", "hierarchical"), ("none", "bf16", "fp16", "powersgd")
        )
    }


def trial(extra):
    """'ok', or what went wrong."""
    with tempfile.TemporaryDirectory(prefix="recovery-sums-") as cwd:
        try:
            result = subprocess.run(
                [sys.executable, str(REPO / "train.py"), *RUN, *extra, "--metrics", ""],
                cwd=cwd,
                env=dict(os.environ, RING_INSTRUMENTS=json.dumps({"faults": FAULT})),  # (instruments.environ_for's)
                capture_output=True,
                text=True,
                timeout=300,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired:
            return "timed out"
    out = result.stdout
    if result.returncode != 0:
        return f"exit {result.returncode}: {result.stderr.strip().splitlines()[-1:]}"
    if "continuing on 2 ranks" not in out or "parameters identical on all 2 ranks" not in out:
        return "did not go on to the end on 2 ranks"
    if (DROPPED in out) != ("powersgd" in extra):
        return "PowerSGD's error feedback: " + ("not dropped" if "powersgd" in extra else "dropped without PowerSGD")
    return "ok"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="the combinations whose name contains this")
    args = parser.parse_args(argv)
    failed = 0
    for name, extra in combinations().items():
        if args.only in name:
            outcome = trial(extra)
            failed += outcome != "ok"
            print(f"{name:24} {outcome}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
