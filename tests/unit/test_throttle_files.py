"""scripts/throttle.py's writes, on a folder laid out as each cgroup version's (the machine here
has v1 only; tests/cluster/test_throttle.py holds real processes to real quotas as root)."""

import os

import pytest
import throttle


def test_on_cgroup_v2_a_quota_is_cpu_max_over_a_10_ms_period(tmp_path, monkeypatch):
    monkeypatch.setattr(throttle, "ROOT", tmp_path)
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory\n")
    with throttle.CpuQuota("v2") as quota:
        assert quota.version == 2 and quota.path.parent == tmp_path
        assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu"  # children may use the controller
        quota.set(0.5)
        assert (quota.path / "cpu.max").read_text() == f"{throttle.PERIOD_US // 2} {throttle.PERIOD_US}"
        quota.set(None)
        assert (quota.path / "cpu.max").read_text() == f"max {throttle.PERIOD_US}"
        quota.add(os.getpid())
        assert (quota.path / "cgroup.procs").read_text() == str(os.getpid())
    assert (tmp_path / "cgroup.procs").read_text() == str(os.getpid())  # moved back to the parent on the way out


def test_on_cgroup_v1_a_quota_is_cfs_quota_over_cfs_period(tmp_path, monkeypatch):
    monkeypatch.setattr(throttle, "ROOT", tmp_path)
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    with throttle.CpuQuota("v1") as quota:
        assert quota.version == 1 and quota.path.parent == tmp_path / "cpu"
        quota.set(0.25)
        assert (quota.path / "cpu.cfs_period_us").read_text() == str(throttle.PERIOD_US)
        assert (quota.path / "cpu.cfs_quota_us").read_text() == str(throttle.PERIOD_US // 4)
        quota.set(None)
        assert (quota.path / "cpu.cfs_quota_us").read_text() == "-1"
        with pytest.raises(ValueError, match="at least 0.1 of a core"):
            quota.set(0.05)


def test_without_a_cpu_controller_it_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(throttle, "ROOT", tmp_path)
    (tmp_path / "cgroup.controllers").write_text("memory io\n")  # v2 without cpu
    with pytest.raises(throttle.ThrottleError, match="no CPU controller"):
        throttle.CpuQuota().__enter__()
