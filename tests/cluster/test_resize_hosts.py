"""Resuming on another number of hosts: a job stopped on three emulated servers (scripts/cluster.py,
network namespaces: needs root; in CI (CI=true) its absence is a failure) resumes on two and ends
about as accurate as a run that never stopped. (On loopback ranks: tests/world/test_resize.py.)"""

import os
import re
import signal

import procs
import pytest
from procs import checkpoint_position, final_digest, wait_for


def accuracy(stdout):
    return float(re.search(r"test accuracy ([\d.]+)%", stdout).group(1))


@pytest.mark.timeout(900)
def test_a_job_stopped_on_three_hosts_resumes_on_two(needs_root, tmp_path):
    """Emulated servers (scripts/cluster.py): SIGTERM to host 1's rank mid-epoch stops all three, saved;
    the job then goes on with hosts 0 and 1 alone, from the next image, and ends within 0.1 percentage
    point of a run that never stopped."""
    import cluster
    from hosts import NICS, report, start_ranks, wait_ranks

    settings = ["--train-subset", "3200", "--epochs", "1", "--metrics", "", "--save-every", "4", "--timeout", "30"]
    unresized = procs.wait_all(
        procs.start_ranks(
            3, [*settings, "--checkpoint", str(tmp_path / "u.pt"), "--save-path", str(tmp_path / "u.pth")]
        ),
        timeout=300,
    )
    assert [code for code, _, _ in unresized] == [0, 0, 0], [err for _, _, err in unresized]

    checkpoint = tmp_path / "c.pt"
    job = [*settings, "--checkpoint", str(checkpoint), "--save-path", str(tmp_path / "m.pth")]
    with cluster.Cluster(3, nics=NICS, starter=procs.popen) as c:
        (tmp_path / "three").mkdir()
        started = start_ranks(c, [c.train_argv(r, 29500, job) for r in range(3)], tmp_path / "three")
        wait_for(lambda: checkpoint.exists() or any(p.poll() is not None for p in started), 240, "training")
        os.killpg(started[1].pid, signal.SIGTERM)  # host 1's rank (its own session)
        results = wait_ranks(c, started, tmp_path / "three", timeout=60)
        assert [code for code, *_ in results] == [3, 3, 3], report(results)
        step = checkpoint_position(checkpoint)[1]
        assert all(f"stopped after epoch 1, step {step}/50 (SIGTERM to rank 1)" in err for _, _, err, _ in results)

        (tmp_path / "two").mkdir()
        argvs = [[*c.train_argv(r, 29501, job), "--resume"] for r in range(2)]
        for argv in argvs:
            argv[argv.index("--world-size") + 1] = "2"
        results = wait_ranks(c, start_ranks(c, argvs, tmp_path / "two"), tmp_path / "two", timeout=300)
    assert [code for code, *_ in results] == [0, 0], report(results)
    out = results[0][1]
    assert f"after step {step}; resuming on 2 ranks; the checkpoint was made on 3" in out, out
    assert "parameters identical on all 2 ranks" in out
    assert abs(accuracy(out) - accuracy(unresized[0][1])) <= 0.1, (out, unresized[0][1])
    assert final_digest(out) != final_digest(unresized[0][1])  # resized: the same run, not the same bits
