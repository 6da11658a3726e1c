"""utils/balance/cpu.py: a rank's own time from its CPU, its waits and its group's stalls, read from the
kernel's counter files without letting the GIL go."""

import sys
import threading
import time

import pytest

from utils.balance.cpu import CpuGroup, own_seconds, snapshot


def test_a_ranks_own_time_is_its_cpu_and_the_longer_of_its_waits_and_stalls():
    start = (10.0, 1.0, 2.0, 100.0)  # CPU s, waited s, stalled s, clock
    assert own_seconds(start, (10.5, 1.0, 2.0, 101.0), threads=1) == 0.5  # waiting for peers: not counted
    assert own_seconds(start, (12.0, 1.0, 2.0, 101.0), threads=4) == 0.5  # 4 torch threads side by side
    assert own_seconds(start, (10.5, 1.2, 2.0, 101.0), threads=1) == pytest.approx(0.7)  # no CPU for 0.2 s
    assert own_seconds(start, (10.5, 1.2, 2.3, 101.0), threads=1) == pytest.approx(0.8)  # a quota's stall
    assert own_seconds(start, (10.5, 1.0, 5.0, 101.0), threads=1) == pytest.approx(1.5)  # stalls on 2 CPUs: capped


def test_a_cpu_groups_quota_and_stalls_are_read_from_its_files_kept_open_cgroup_v1_and_v2(tmp_path):
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    v1.mkdir(), v2.mkdir()
    assert CpuGroup(v1).cores() is None and CpuGroup(v1).stalled() == 0.0  # nothing to read
    (v1 / "cpu.stat").write_text("nr_periods 3\nnr_throttled 1\nthrottled_time 250000000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    group = CpuGroup(v1)
    assert group.cores() is None and group.stalled() == 0.25  # v1, no quota
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")  # (the files it has open, read again from their start)
    (v1 / "cpu.stat").write_text("nr_periods 9\nnr_throttled 4\nthrottled_time 1500000000\n")
    assert group.cores() == 0.5 and group.stalled() == 1.5
    (v2 / "cpu.stat").write_text("usage_usec 10\nthrottled_usec 2000000\n")
    (v2 / "cpu.max").write_text("max 100000\n")
    group = CpuGroup(v2)
    assert group.cores() is None and group.stalled() == 2.0  # v2, no quota
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert group.cores() == 1.5


def test_a_ranks_clocks_read_the_kernels_counters_with_the_gil_held(tmp_path):
    """--balance reads counter files twice a step (Balance.now). A read that let the GIL go handed
    it to the sum's thread, and the training thread waited to get it back (70-90 µs a read, about
    2% of a step: bench/balance/NOTES.md). Here a spinning thread gets no turn while the main thread takes
    200 snapshots (with os.pread instead, it spun about a billion times: the main thread lost the
    GIL at its reads, not only when the switch interval forced it to)."""
    (tmp_path / "cpu.stat").write_text("throttled_usec 0\n")
    group = CpuGroup(tmp_path)
    snapshot(group)  # (the files are opened here: open() lets the GIL go)
    spins, done = [0], threading.Event()

    def spin():
        while not done.is_set():
            spins[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # (a slow machine's 200 snapshots are not cut short by a forced switch)
    spinner = threading.Thread(target=spin)
    try:
        spinner.start()
        time.sleep(0.01)  # (the spinner runs; the main thread waits for its turn)
        before = spins[0]
        for _ in range(200):
            snapshot(group)
        spun = spins[0] - before
    finally:
        done.set()
        sys.setswitchinterval(interval)
        spinner.join()
    assert spun == 0
