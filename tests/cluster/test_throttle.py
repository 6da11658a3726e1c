"""Slow servers for real (scripts/throttle.py, `cluster.py --cpu`): a cgroup CPU quota holds a busy
process to its share, changes while it runs (`--cpu HOST=FRACTION@SECONDS`: from a given moment),
follows the processes an emulated host starts, and leaves nothing behind. Needs root; in CI
(CI=true) its absence is a failure."""

import os
import subprocess
import sys
import time

import procs
import pytest
import throttle

BUSY = [sys.executable, "-c", "while True: pass"]
CLUSTER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts", "cluster.py"
)


def cpu_seconds(pid):
    """User + system CPU of process `pid` so far."""
    fields = procs.stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cores_used(pid, seconds):
    """The share of one core `pid` used over the next `seconds`."""
    start, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - start) / (time.monotonic() - t0)


def cgroup_of(pid):
    with open(f"/proc/{pid}/cgroup") as f:
        return f.read()


@pytest.mark.timeout(60)
def test_a_quota_holds_a_busy_process_to_its_share_and_changes_while_it_runs(needs_root):
    busy = subprocess.Popen(BUSY)
    try:
        with throttle.CpuQuota("test") as quota:
            quota.set(0.2)
            quota.add(busy.pid)
            assert quota.path.name in cgroup_of(busy.pid)
            low = cores_used(busy.pid, 2.0)
            quota.set(0.6)
            high = cores_used(busy.pid, 2.0)
            group = quota.path
        # the quota is a ceiling (CFS bandwidth over 10 ms periods); a loaded machine may give less
        assert 0.05 < low <= 0.26, low
        assert 1.5 * low < high <= 0.66, (low, high)
        assert not group.exists() and group.name not in cgroup_of(busy.pid)  # moved back, group removed
        assert cores_used(busy.pid, 0.5) > 0.0
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.timeout(60)
def test_a_group_left_by_a_killed_owner_is_removed_by_the_next(needs_root):
    parent, _ = throttle.controller()
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stale = parent / f"{throttle.NAME_PREFIX}-{owner.pid}-0"
    stale.mkdir()
    owner.kill()
    owner.wait()
    with throttle.CpuQuota("next"):
        assert not stale.exists()


def cluster_exec(cpu, script):
    """`python -c script` on 2 emulated hosts under `--cpu cpu` ({{ }} in it: cluster.py's command
    templates fill in {rank} and the like): {host: the words of the line it printed}."""
    result = subprocess.run(
        [sys.executable, CLUSTER, "exec", "--hosts", "2", "--cpu", cpu, "--", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return {line.split("]")[0].split()[0][1:]: line.split("]", 1)[1].split() for line in result.stdout.splitlines()}


@pytest.mark.timeout(120)
def test_cluster_cpu_slows_one_emulated_host(needs_root):
    # each rank (one a host) spins for 2 s of wall time, then says how much CPU it got
    spin = "import time; t = time.time()\nwhile time.time() - t < 2: pass\nprint(f'cpu {{time.process_time():.2f}}')"
    got = {host: float(said[-1]) for host, said in cluster_exec("1=0.25", spin).items()}
    assert set(got) == {"host0", "host1"}, got
    assert got["host1"] <= 0.25 * 2.5, got  # its quota over about 2 s (plus the interpreter's start)
    assert got["host0"] > got["host1"], got  # the quota is host 1's alone


@pytest.mark.timeout(120)
def test_cluster_cpu_at_a_given_moment_slows_a_host_from_then_on(needs_root):
    """--cpu 1=0.25@1.5: host 1 runs free for its first 1.5 s, then at a quarter of a core. Each
    rank spins 4 s and says its CPU seconds a second over its first second and its last two."""
    spin = (
        "import time; t = time.time()\n"
        "while time.time() - t < 1: pass\n"
        "a = time.process_time()\n"
        "while time.time() - t < 2: pass\n"
        "b = time.process_time()\n"
        "while time.time() - t < 4: pass\n"
        "print(f'rates {{a:.2f}} {{(time.process_time() - b) / 2:.2f}}')"
    )
    got = cluster_exec("1=0.25@1.5", spin)
    before, after = (float(x) for x in got["host1"][-2:])
    assert after <= 0.3, got  # held to its quota from 1.5 s on
    assert before > 0.35 and before > after + 0.1, got  # free before (the interpreter's start counts too)
