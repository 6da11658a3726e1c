"""Ranks on emulated servers (scripts/cluster.py): starting them, waiting for them, what was made.
The helpers tests/cluster/test_multihost.py, test_recovery_multihost.py, test_heal_cut.py and test_resize_hosts.py
share, and what is left of emulated hosts (test_slurm_cluster.py, test_ssh_hosts.py)."""

import subprocess
import time
from pathlib import Path

NICS = ["eth0", "ens3", "enp1s0"]
ENV = {"OMP_NUM_THREADS": "1"}  # 2 cores shared by all ranks

_created = []  # every namespace / veth / bridge name a cluster of this module had


def remember(c):
    _created.extend([*c.names, *c.veths, c.bridge])
    return c


def existing_names():
    """Names of all network namespaces and links (root namespace) on this machine right now."""
    nss = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=15, check=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=15, check=True).stdout
    return {line.split()[0] for line in nss.splitlines() if line.strip()} | {
        line.split(":")[1].strip().split("@")[0] for line in links.splitlines()
    }


def left_of(names):
    return sorted(set(names) & existing_names())


def processes_mentioning(text):
    """Pids whose command line contains `text` (daemons name their temporary directory in their arguments)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def start_ranks(c, argvs, logdir, env=ENV):
    """Start argvs[r] (rank r) on its host in its own directory logdir/host<r> (the hosts share one
    filesystem; default paths such as runs/checkpoint.pt are relative), stdout/stderr to files."""
    procs = []
    for r, argv in enumerate(argvs):
        home = logdir / f"host{r}"
        home.mkdir(exist_ok=True)
        with open(logdir / f"rank{r}.out", "wb") as out, open(logdir / f"rank{r}.err", "wb") as err:
            procs.append(
                c.popen(c.host_of(r), argv, env=env, cwd=home, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
            )
    return procs


def wait_ranks(c, procs, logdir, timeout):
    """Wait until every rank exited, at most `timeout` s (then kill all and fail).

    Returns [(returncode, stdout, stderr, seconds until it exited)].
    """
    start, exited = time.monotonic(), {}
    while len(exited) < len(procs):
        for r, p in enumerate(procs):
            if r not in exited and p.poll() is not None:
                exited[r] = time.monotonic() - start
        if time.monotonic() - start > timeout:
            for p in procs:
                c.kill(p)
            break
        time.sleep(0.05)
    results = [
        (
            p.wait(timeout=10),
            (logdir / f"rank{r}.out").read_text(),
            (logdir / f"rank{r}.err").read_text(),
            exited.get(r),
        )
        for r, p in enumerate(procs)
    ]
    missing = [r for r in range(len(procs)) if r not in exited]
    assert not missing, f"ranks {missing} still running after {timeout} s; killed\n" + report(results)
    return results


def report(results):
    return "\n".join(
        f"--- rank {r}: exit {code} after {secs} s\nstdout:\n{out}\nstderr:\n{err}"
        for r, (code, out, err, secs) in enumerate(results)
    )
