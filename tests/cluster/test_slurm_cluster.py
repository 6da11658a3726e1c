"""The emulated Slurm cluster (tests/support/slurm_cluster.py) works: a 2-node sbatch job whose srun tasks
run on node1 and node2, each seeing its own hostname, NIC and address, and nothing is left behind.

Needs root and slurm-wlm + munge; in CI (CI=true) their absence is a failure, never a skip.
"""

import os
import re
import subprocess

import pytest
from hosts import processes_mentioning
from slurm_cluster import ETC_NETNS, SlurmCluster, require_slurm

pytestmark = pytest.mark.usefixtures("needs_root")  # tests/conftest.py

TASK = r"""#!/bin/sh
#SBATCH --nodes=2 --ntasks-per-node=1 --time=2 --output=job-%j.out
srun sh -c 'echo "task $(hostname) $SLURM_PROCID $SLURM_NODEID $SLURM_NODELIST $(ip -o -4 addr show scope global)"'
"""
TASK_LINE = re.compile(r"^task (\S+) (\d+) (\d+) (\S+) \d+: (\S+)\s+inet (\d+\.\d+\.\d+\.\d+)/", re.MULTILINE)


@pytest.fixture
def slurm_installed():
    require_slurm()


def namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=15, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.mark.timeout(120)
def test_two_node_job_runs_on_both_nodes_and_nothing_is_left(slurm_installed, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(TASK)
    with SlurmCluster(nodes=2, workdir=tmp_path) as c:
        temp_dir, names = str(c.dir), list(c.net.names)
        job = c.sbatch(script)
        info = c.wait_job(job, timeout=60)
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (info, c.log_tails())
        out = (tmp_path / f"job-{job}.out").read_text()
        tasks = sorted(TASK_LINE.findall(out))
        assert tasks == [
            ("node1", "0", "0", "node[1-2]", c.nic(1), c.addr(1)),
            ("node2", "1", "1", "node[1-2]", c.nic(2), c.addr(2)),
        ], out
        assert c.nic(1) != c.nic(2)
    assert not processes_mentioning(temp_dir)
    assert not set(names) & namespaces()
    assert not [ns for ns in names if (ETC_NETNS / ns).exists()]
    assert not os.path.exists(temp_dir)
