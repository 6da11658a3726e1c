#!/usr/bin/env python3
"""From Enter to the first step on 3 emulated servers: `train.py --hosts` against the per-server commands.

    sudo python bench/launcher/first_step.py [--rounds 3] [--results-dir DIR]

Each server is a network namespace with its own card, sshd and copy of the program's folder
(tests/support/ssh_hosts.py); this machine's root namespace is the laptop. Each round, in turn:
- one command: `python train.py --hostfile FILE ...` started here; the clock stops at rank 0's
  first step, the line `epoch 1: 1/12 steps` as the launcher shows it;
- the original's way, at a person's best: the three per-server commands, with their cards, sent
  over ssh at the same instant (no typing, no logging in counted); the clock stops at the same line.
The job is 12 steps of 64 images; the rest of it is not timed. Medians over the rounds, in seconds.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tests" / "support")]

from ssh_hosts import SshHosts  # noqa: E402

JOB = ["--epochs", "1", "--train-subset", "768", "--test-subset", "100", "--metrics", ""]
FIRST = "epoch 1: 1/12 steps"


def until_first_step(procs, timeout=120):
    """Seconds until a line of procs[0]'s output holds FIRST; every process killed after."""
    started = time.monotonic()
    try:
        for line in procs[0].stdout:
            if FIRST in line.decode(errors="replace"):
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                break
        raise RuntimeError("no first step")
    finally:
        for p in procs:
            p.wait(timeout)


def one_command(h, folders, laptop):
    hostfile = laptop / "hostfile"
    hostfile.write_text("".join(f"{n} dir={f}\n" for n, f in zip(h.ssh_names, folders)))
    argv = [sys.executable, str(REPO / "train.py"), "--hostfile", str(hostfile), *JOB]
    launcher = subprocess.Popen(argv, cwd=laptop, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return until_first_step([launcher])


def by_hand(h, folders, port=23600):
    procs = []
    for r, folder in enumerate(folders):
        command = [sys.executable, "-u", "train.py", *JOB, "--rank", str(r), "--world-size", "3"]
        command += ["--init-method", f"tcp://{h.addrs[0]}:{port}", "--gloo_socket_ifname", h.nics[r]]
        typed = f"cd {shlex.quote(str(folder))} && {shlex.join(command)}"
        ssh = [*h.ssh_command, h.names[r], typed]
        procs.append(subprocess.Popen(ssh, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return until_first_step(procs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--results-dir", default=str(REPO / "bench" / "results" / "launcher"))
    args = ap.parse_args()
    if not 1 <= args.rounds <= 100:
        ap.error("--rounds: 1 to 100")
    times = {"one command": [], "per-server commands": []}
    with tempfile.TemporaryDirectory() as tmp, SshHosts(3, tmp, system_config=True) as h:
        folders = h.program_folders()
        for n in range(args.rounds):
            laptop = Path(tmp) / f"laptop{n}"
            laptop.mkdir()
            times["one command"].append(one_command(h, folders, laptop))
            times["per-server commands"].append(by_hand(h, folders, 23600 + n))
    result = {k: {"seconds": v, "median": statistics.median(v)} for k, v in times.items()}
    for name, r in result.items():
        print(f"{name:22s} median {r['median']:.2f} s  ({', '.join(f'{s:.2f}' for s in r['seconds'])})")
    os.makedirs(args.results_dir, exist_ok=True)
    Path(args.results_dir, "first_step.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
