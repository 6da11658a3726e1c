"""--balance with real processes: unequal shares work with every kind of sum, and resume bit for bit
from the checkpoint, after a stop on as many ranks and after a lost rank on fewer; a lost rank while
measuring; a server joins a balanced job. (A rank slowed by a real CPU quota, which needs root:
tests/cluster/test_balance_throttled.py.)"""

import json
import os

import procs
import pytest
from procs import final_digest

from utils.observe.instruments import environ_for, read_events


def last_row(folder):
    """The last line of metrics.jsonl of a run in `folder`: its last epoch's."""
    return json.loads((folder / "runs" / "metrics.jsonl").read_text().splitlines()[-1])


SHORT = ["--epochs", "1", "--train-subset", "1920", "--test-subset", "200", "--timeout", "60"]
K = 12  # of 30 steps


def faulted(fault, args, cwd):
    return procs.train([*SHORT, *args], timeout=200, cwd=cwd, env=dict(os.environ, **environ_for(faults=fault)))


LATE = 26  # of 30 steps: too few left for a measuring --balance to move (its codes need MEASURED timed steps)


@pytest.mark.timeout(300)
def test_unequal_shares_resume_bit_for_bit_after_a_stop_from_the_checkpoint(tmp_path):
    """Stopped at step K with fixed 3:1 shares, resumed twice: with 3:1 again, and with a measuring
    --balance, which starts from the checkpoint's shares (equal shares would end elsewhere) and
    holds them for the last steps. Both end bit for bit as the run that never stopped."""
    straight = procs.train([*SHORT, "--nproc", "2", "--balance", "3:1"], timeout=200, cwd=str(tmp_path))
    assert straight.returncode == 0 and "batch 64 (shared 3:1)" in straight.stdout, straight.stderr
    assert "shares 48.0/16.0" in straight.stdout, straight.stdout
    for stop, balance in ((K, "3:1"), (LATE, None)):
        (tmp_path / f"stopped-{stop}").mkdir()
        stopped = faulted(f"1:{stop}:TERM", ["--nproc", "2", "--balance", "3:1"], str(tmp_path / f"stopped-{stop}"))
        assert stopped.returncode == 3 and f"stopped after epoch 1, step {stop}/30" in stopped.stderr, stopped.stderr
        flags = ["--balance", *([balance] if balance else []), "--resume"]
        resumed = procs.train([*SHORT, "--nproc", "2", *flags], timeout=200, cwd=str(tmp_path / f"stopped-{stop}"))
        assert resumed.returncode == 0 and "shares from the checkpoint: 48/16" in resumed.stdout, resumed.stderr
        assert final_digest(resumed.stdout) == final_digest(straight.stdout), balance


KINDS = {
    "plain": ["--no-overlap"],
    "lazy update": ["--lazy-update"],
    "bf16": ["--compress", "bf16"],
    "powersgd": ["--compress", "powersgd"],
    "ring": ["--allreduce", "ring"],
    "gloo": ["--allreduce", "gloo"],
    "hierarchical": ["--allreduce", "hierarchical"],
    "sync every 4": ["--sync-every", "4"],
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", KINDS)
def test_unequal_shares_with_every_kind_of_sum_train_every_image_and_end_identical(kind, tmp_path):
    """Fixed 3:1 shares (so that every step is cut unequally) under each of the other sums' options."""
    done = procs.train([*SHORT, "--nproc", "2", "--balance", "3:1", *KINDS[kind]], timeout=150, cwd=str(tmp_path))
    assert done.returncode == 0 and "parameters identical on all 2 ranks" in done.stdout, done.stderr[-3000:]
    row = last_row(tmp_path)
    assert row["images"] == 1920 and row["shares"] == [48.0, 16.0] and row["test_accuracy"] > 0.5, row


@pytest.mark.timeout(300)
def test_a_lost_rank_while_balanced_goes_on_with_equal_shares_as_a_resume_on_fewer_would(tmp_path):
    """Rank 2 of 3 (shares 3:1:1) killed as step K+1 begins: the two left go on with equal shares,
    and end as the job stopped after K and resumed on 2 ranks with --balance 1:1 does."""
    (tmp_path / "shrunk").mkdir()
    (tmp_path / "stopped").mkdir()
    shrunk = faulted(f"2:{K + 1}:KILL", ["--nproc", "3", "--balance", "3:1:1"], str(tmp_path / "shrunk"))
    assert shrunk.returncode == 0 and "parameters identical on all 2 ranks" in shrunk.stdout, shrunk.stderr
    stopped = faulted(f"0:{K}:TERM", ["--nproc", "3", "--balance", "3:1:1"], str(tmp_path / "stopped"))
    assert stopped.returncode == 3, stopped.stderr
    resumed = procs.train(
        [*SHORT, "--nproc", "2", "--balance", "1:1", "--resume"], timeout=200, cwd=str(tmp_path / "stopped")
    )
    assert resumed.returncode == 0 and "shares from the checkpoint" not in resumed.stdout, resumed.stderr
    assert final_digest(shrunk.stdout) == final_digest(resumed.stdout)
    row = last_row(tmp_path / "shrunk")
    assert row["images"] == 1920 and len(row["shares"]) == 2, row


@pytest.mark.timeout(300)
def test_a_lost_rank_while_measuring_the_survivors_measure_afresh_and_end_identical(tmp_path):
    """Rank 2 of 3 killed as step K+1 begins under a measuring --balance: the two left start again
    from equal shares (a new group), cut each step alike and end with identical parameters."""
    events = tmp_path / "events.jsonl"
    env = dict(os.environ, **environ_for(faults=f"2:{K + 1}:KILL", events=str(events)))
    shrunk = procs.train([*SHORT, "--nproc", "3", "--balance"], timeout=200, cwd=str(tmp_path), env=env)
    assert shrunk.returncode == 0 and "parameters identical on all 2 ranks" in shrunk.stdout, shrunk.stderr[-3000:]
    row = last_row(tmp_path)
    assert row["images"] == 1920 and len(row["shares"]) == 2, row
    seen = read_events(events)
    after = [(e["rank"], e["step"], e["shares"]) for e in seen if e["event"] == "shares" and e["step"] > K + 1]
    assert after and all(len(shares) == 2 and sum(shares) == 64 for _, _, shares in after), after
    by_rank = [[(step, shares) for rank, step, shares in after if rank == r] for r in (0, 1)]
    assert by_rank[0] == by_rank[1], after  # the survivors agree at every review


JOIN_RUN = ["--epochs", "1", "--train-subset", "6400", "--test-subset", "200", "--timeout", "60", "--balance"]


@pytest.mark.timeout(300)
def test_a_server_joins_a_balanced_job(tmp_path):
    port = procs.free_port()
    ranks = procs.start_ranks(2, [*JOIN_RUN, "--save-every", "5"], port, str(tmp_path))
    joiner = None
    try:
        procs.wait_for(
            lambda: procs.checkpoint_position(tmp_path / "runs" / "checkpoint.pt") is not None, 120, "training to begin"
        )
        joiner = procs.start_rank(2, 3, [*JOIN_RUN, "--join"], port, tmp_path)
        results = procs.wait_all([*ranks, joiner], timeout=240)
    finally:
        for p in [*ranks, *([joiner] if joiner else [])]:
            procs.kill_group(p)
    assert [code for code, _, _ in results] == [0, 0, 0], [err[-3000:] for _, _, err in results]
    assert "parameters identical on all 3 ranks" in results[0][1], results[0][1]
    row = last_row(tmp_path)
    assert row["images"] == 6400 and row["members"] == [0, 1, 2] and len(row["shares"]) == 3, row
