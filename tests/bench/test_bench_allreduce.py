"""bench/allreduce/allreduce.py end to end on loopback: it runs, writes its results, and its checks bite."""

import json
import os
import subprocess
import sys

import procs
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "bench", "allreduce", "allreduce.py")
ALGORITHMS = {"gloo", "two-pass", "two-pass-pipelined", "ring"}
QUICK = ["--world-sizes", "2", "--sizes", "4K,64K", "--iters", "2", "--warmup", "1", "--timeout", "90"]


def bench(tmp_path, *extra):
    # The benchmark kills its own ranks on every exit path; the outer timeout is a last resort.
    return procs.run([sys.executable, BENCH, *QUICK, "--results-dir", str(tmp_path), *extra], cwd=REPO, timeout=110)


@pytest.mark.timeout(120)
def test_loopback_run_writes_every_algorithm_and_passes_correctness(tmp_path):
    r = bench(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "allreduce-loopback.json").read_text())
    assert data["correct"] is True and data["failures"] == []
    rows = data["results"]
    assert {row["algorithm"] for row in rows} == ALGORITHMS
    assert {(row["size"], row["bytes"]) for row in rows} == {("4K", 4096), ("64K", 65536)}
    for row in rows:
        assert row["world_size"] == 2 and row["iters"] == 2 and len(row["times_ms"]) == 2
        assert row["correct"] and row["bit_identical"] and row["max_error_over_bound"] <= 1.0
        assert row["median_ms"] > 0 and row["busbw_MBps"] == pytest.approx(row["algbw_MBps"])  # N=2: 2(N-1)/N = 1
    pipelined = {row["size"]: row["chunks"] for row in rows if row["algorithm"] == "two-pass-pipelined"}
    assert pipelined == {"4K": 1, "64K": 1}  # auto_chunks: one 256 KiB piece covers both
    assert (tmp_path / "allreduce-loopback.png").stat().st_size > 10_000
    assert "| N | size |" in r.stdout and "| 2 | 64K | 65536 | ring |" in r.stdout
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault, message", [("wrong", "wrong sum"), ("diverge", "ranks disagree bit-wise")])
def test_a_wrong_or_diverging_result_fails_the_run(tmp_path, fault, message):
    # --self-test-fault spoils the last algorithm's result after the timed call: "wrong" on
    # every rank alike (only the reference check can see it), "diverge" by one ulp on one rank
    # (inside the rounding bound, so only the bit-identity check can see it).
    r = bench(tmp_path, "--self-test-fault", fault)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "CORRECTNESS FAILURE" in r.stderr and f"algorithm=ring: {message}" in r.stderr
    data = json.loads((tmp_path / "allreduce-loopback.json").read_text())
    assert data["correct"] is False
    assert {row["algorithm"] for row in data["results"] if not row["correct"]} == {"ring"}


@pytest.mark.timeout(120)
def test_sigterm_kills_every_rank(tmp_path):
    """Like a user's Ctrl-C or a scheduler's SIGTERM: the benchmark exits 130 and no rank survives it."""
    import signal
    import time

    job = procs.popen(
        [
            sys.executable,
            BENCH,
            "--world-sizes",
            "3",
            "--sizes",
            "16M",
            "--iters",
            "50",
            "--results-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:

        def ranks():  # this job's ranks only: another test's benchmark may run beside this one
            return [pid for pid in os.listdir("/proc") if pid.isdigit() and _is_rank(pid, job.pid)]

        deadline = time.time() + 60
        while len(ranks()) < 3 and time.time() < deadline:
            time.sleep(0.2)
        started = ranks()
        assert len(started) == 3, "the ranks never started"
        job.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=30)
        assert job.returncode == 130 and "interrupted; killed all ranks" in err, (job.returncode, err)
        time.sleep(0.5)
        assert [pid for pid in started if _is_rank(pid)] == []  # an orphan has a new parent
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def _is_rank(pid, parent=None):
    """A live allreduce.py worker (a zombie has no command line), started by `parent` if given."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().split(b"\0")
        with open(f"/proc/{pid}/comm", "rb") as f:
            forked = f.read().startswith(b"worker ")  # by the driver's fork server: the command line is its
        ppid = int(procs.stat(pid)[1])
        grandparent = int(procs.stat(ppid)[1]) if forked else None
    except (OSError, ValueError, IndexError):
        return False
    if forked:
        return cmdline != [b""] and (parent is None or grandparent == parent)
    is_worker = b"--worker" in cmdline and any(BENCH.encode() in part for part in cmdline)
    return is_worker and (parent is None or ppid == parent)


def test_sign_test_tells_a_tie_from_a_real_difference():
    from stats import sign_test_p

    assert sign_test_p(20, 41) == 1.0 and sign_test_p(21, 41) == 1.0  # an even split: no difference
    assert sign_test_p(0, 5) == pytest.approx(2 / 32)  # 5 of 5 one way: 2 * (1/2)^5
    assert sign_test_p(9, 31) == pytest.approx(sign_test_p(22, 31))  # two-sided
    assert sign_test_p(9, 31) < 0.05 < sign_test_p(14, 41) < 0.1  # 9/31 is real, 14/41 is not
    assert sign_test_p(0, 0) == 1.0


def test_a_tiny_p_is_not_printed_as_zero():
    from stats import p_text, sign_test_p

    assert p_text(sign_test_p(15, 15)) == "p<0.001"  # 15 of 15 rounds: p = 6e-5, not "p=0.00"
    assert p_text(0.004) == "p=0.004" and p_text(0.12) == "p=0.12"


def test_each_rate_and_tcp_setting_writes_its_own_results_files():
    """A 1 Gbit/s run once overwrote the committed 200 Mbit/s results: the names now differ."""
    from allreduce import results_stem

    assert results_stem("loopback", None, None, None) == "allreduce-loopback"
    assert results_stem("cluster", "200mbit", None, None) == "allreduce-cluster-200mbit"
    assert results_stem("cluster", "1gbit", None, "reno") == "allreduce-cluster-1gbit-reno"
    assert results_stem("cluster", "200mbit", "/tmp/my_ring.py", "reno") == "allreduce-cluster-200mbit-my_ring-reno"


@pytest.mark.timeout(120)
def test_the_gloo_schedule_candidate_sums_correctly(tmp_path):
    """bench/allreduce/candidates/gloo_schedule.py is measured against gloo in the README: it must be right too
    (N = 3 and the model's 421,642 floats: segments that do not divide evenly)."""
    r = procs.run(
        [
            sys.executable,
            BENCH,
            "--world-sizes",
            "3",
            "--sizes",
            "4K,model",
            "--algorithms",
            "gloo",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--timeout",
            "90",
            "--results-dir",
            str(tmp_path),
            "--candidate",
            os.path.join(REPO, "bench", "allreduce", "candidates", "gloo_schedule.py"),
        ],
        cwd=REPO,
        timeout=110,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads((tmp_path / "allreduce-loopback.json").read_text())["results"]
    candidate = [row for row in rows if row["algorithm"] == "ring:gloo_schedule"]
    assert [row["size"] for row in candidate] == ["4K", "model"]
    assert all(row["correct"] and row["bit_identical"] for row in candidate)
