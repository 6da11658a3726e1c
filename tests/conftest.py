"""Shared fixtures."""

import os

import netns
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# pytest finds utils/, scripts/ and bench/ through pyproject.toml's pythonpath; the processes the
# tests start (ranks, workers, probes) find them through the same folders here.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [REPO, os.path.join(REPO, "scripts"), os.path.join(REPO, "bench"), os.path.join(REPO, "tests")]
    + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)


@pytest.fixture
def needs_root():
    """Emulated hosts need root (CAP_NET_ADMIN). In CI (CI=true) that is a failure, never a skip."""
    try:
        netns._check_privileges()
    except netns.ClusterError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"emulated-host tests must run as root in CI: {e}")
        pytest.skip(f"not root: {e}")


# The slowest files first (measured with --durations; roughly, slowest first), so that with two
# workers and `--dist loadfile` no long file starts last while the other worker sits idle. Files
# not named here follow in their usual order. Only the order changes, never what runs.
SLOWEST_FIRST = [
    "test_faults.py",
    "test_watch.py",
    "test_recovery.py",
    "test_balance.py",
    "test_compress_training.py",
    "test_outputs_lock.py",
    "test_bad_input.py",
    "test_resize.py",
    "test_slurm.py",
    "test_sync_every.py",
    "test_overlap.py",
    "test_bench_recovery.py",
    "test_train.py",
    "test_bench_time_to_accuracy_runs.py",
    "test_multihost.py",
    "test_bench_bad_input.py",
    "test_bench_allreduce.py",
    "test_timeline.py",
    "test_tiny_world.py",
    "test_ring.py",
    "test_torchrun_store.py",
    "test_recovery_multihost.py",
]


def pytest_collection_modifyitems(items):
    def rank(item):
        name = os.path.basename(str(item.path))
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: a file's tests keep their order
