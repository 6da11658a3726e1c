"""The final sha256 of a short run for every gradient-sum combination: the bits a change must keep.

    python bench/digests.py                  # run every combination, compare with bench/results/digests/digests.json
    python bench/digests.py --write          # record this machine's (new here, or an issue asks the bits to change)
    python bench/digests.py --only two-pass  # the combinations whose name contains this

A combination is --allreduce x (--no-overlap | --overlap | --overlap --lazy-update) x --compress,
on 2 ranks (and a few on 3, where the global batch does not divide), a few of --sync-every 8 and
two of --precision bf16;
30 steps: long enough for PowerSGD's 10 warm-up steps to end. Each run is `python train.py` (the
local launcher), 1 thread per rank, with a timeout. Exit code 1 when any digest differs from the table.

The bits depend on the CPU's kernels too (torch picks convolution and matrix kernels by the
CPU's vector units): the file holds a table per machine, and a run compares with its own
machine's; on a machine with none it says so instead of blaming the code.
"""

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TABLE = REPO / "bench" / "results" / "digests" / "digests.json"
SHORT_RUN = ["--epochs", "1", "--train-subset", "1920", "--test-subset", "200", "--metrics", ""]
TIMEOUT = 120


def combinations():
    """{name: extra train.py flags}."""
    found = {}
    modes = {"no-overlap": ["--no-overlap"], "overlap": ["--overlap"], "lazy": ["--lazy-update"]}
    for allreduce, mode, compress in itertools.product(
        ("two-pass", "ring", "gloo", "hierarchical"), modes, ("none", "bf16", "fp16", "powersgd")
    ):
        flags = f"--nproc 2 --allreduce {allreduce} --compress {compress}".split()
        found[f"{allreduce}/{mode}/{compress}"] = [*flags, *modes[mode]]
    for allreduce in ("two-pass", "ring", "hierarchical"):
        found[f"{allreduce}/overlap/powersgd/3-ranks"] = (
            f"--nproc 3 --allreduce {allreduce} --compress powersgd".split()
        )
    for compress in ("none", "bf16", "fp16"):  # --sync-every: 3 rounds of 8 steps and one cut short
        found[f"two-pass/sync-every-8/{compress}"] = f"--nproc 2 --sync-every 8 --compress {compress}".split()
    found["ring/sync-every-8/nesterov"] = "--nproc 2 --allreduce ring --sync-every 8 --outer nesterov".split()
    found["two-pass/sync-every-8/none/3-ranks"] = "--nproc 3 --sync-every 8".split()
    for allreduce, mode in (("two-pass", "overlap"), ("ring", "lazy")):  # --precision bf16 (utils/setup/precision.py)
        found[f"{allreduce}/{mode}/none/precision-bf16"] = [
            *f"--nproc 2 --allreduce {allreduce} --precision bf16".split(),
            *modes[mode],
        ]
    return found


def digest_of(flags):
    with tempfile.TemporaryDirectory(prefix="digests-") as folder:
        files = ["--save-path", f"{folder}/m.pth", "--checkpoint", f"{folder}/c.pt"]
        argv = [sys.executable, str(REPO / "train.py"), *SHORT_RUN, *flags, *files]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        out = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    match = re.search(r"sha256 ([0-9a-f]{64})", out.stdout)
    if out.returncode or not match:
        return f"failed (exit {out.returncode}): {(out.stderr.strip().splitlines() or ['?'])[-1]}"
    return match.group(1)


def machine():
    """What the bits depend on besides the code: the CPU, torch's kernel choice, torch's version."""
    import torch

    model = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        "unknown CPU",
    )
    return f"{model}, torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}"


def tables(path):
    """{machine: {combination: digest}} recorded in `path` (an older file: one machine's table)."""
    found = json.loads(path.read_text()) if path.exists() else {"machines": {}}
    return found["machines"] if "machines" in found else {found["machine"]: found["digests"]}


def main(argv=None):
    p = argparse.ArgumentParser(prog="bench/digests.py", description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="record this machine's digests in the table")
    p.add_argument("--only", default="", help="only the combinations whose name contains this")
    args = p.parse_args(argv)
    machines, here = tables(TABLE), machine()
    recorded = machines.get(here, {})
    if not recorded and machines:
        print(f"note: no digests recorded on this machine ({here}); recorded on: {'; '.join(sorted(machines))}")
    got, differ = {}, []
    for name, flags in combinations().items():
        if args.only not in name:
            continue
        start = time.time()
        got[name] = digest_of(flags)
        verdict = "new" if name not in recorded else "same" if recorded[name] == got[name] else "DIFFERS"
        if verdict == "DIFFERS":
            differ.append(name)
        print(f"{name:40s} {got[name][:16]}  {verdict:8s} {time.time() - start:4.1f} s", flush=True)
    if args.write:
        machines[here] = {**recorded, **got}
        TABLE.write_text(json.dumps({"machines": machines}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(got)} digests of this machine to {TABLE}")
    if recorded:
        print(f"{len(got) - len(differ)} of {len(got)} as recorded here")
    elif not args.write:
        print("nothing recorded here yet: --write on the code before a change, then run again after it")
    return 1 if differ and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
