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
