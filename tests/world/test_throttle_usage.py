"""`cluster.py --cpu` with a bad limit: one line and exit 2, before any emulated host is made (no
root needed). (The quotas themselves: tests/cluster/test_throttle.py.)"""

import os
import subprocess
import sys

import pytest

CLUSTER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts", "cluster.py"
)


@pytest.mark.parametrize(
    "cpu, message",
    [
        ("2=0.5", "--cpu names host 2, but the hosts are 0..1"),
        ("1=0", "a host's CPU is 0.1 to 64 cores, got 0 for host 1"),
        ("1", "expected HOST=FRACTION[@SECONDS]"),
        ("1=half", "expected HOST=FRACTION[@SECONDS]"),
    ],
)
def test_a_bad_cpu_limit_is_one_line_and_exit_2(cpu, message):
    result = subprocess.run(
        [sys.executable, CLUSTER, "exec", "--hosts", "2", "--cpu", cpu, "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
