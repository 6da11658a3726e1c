"""Shared fixtures."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import netns  # noqa: E402


@pytest.fixture
def needs_root():
    """Emulated hosts need root (CAP_NET_ADMIN). In CI (CI=true) that is a failure, never a skip."""
    try:
        netns._check_privileges()
    except netns.ClusterError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"emulated-host tests must run as root in CI: {e}")
        pytest.skip(f"not root: {e}")
