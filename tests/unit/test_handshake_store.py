"""The start-up handshake's protocol (utils/distributed.handshake) in one process: ranks as threads
on an in-memory store, each with the identity it is given (a torch version cannot be changed for
real; tests/world/test_handshake.py runs real ranks with other world sizes and programs)."""

import threading
import time

import pytest
import torch.distributed as dist

from utils.errors import PeerError, UsageError
from utils.setup import distributed
from utils.setup.program import differences

SAME = {"torch": "2.14.1", "program": "0123456789abcdef"}


def handshakes(monkeypatch, identities, world_sizes, seconds=20.0):
    """Run the handshake of rank r (identity identities[r], world size world_sizes[r]) for every r
    given; {rank: "ok" or "ErrorType: line"}, and the seconds it took."""
    monkeypatch.setattr(distributed, "identity", lambda: identities[int(threading.current_thread().name)])
    store, results = dist.HashStore(), {}

    def one(rank):
        try:
            distributed.handshake(store, rank, world_sizes[rank], seconds, "not every rank came")
            results[rank] = "ok"
        except (UsageError, PeerError) as e:
            results[rank] = f"{type(e).__name__}: {e}"

    started = time.monotonic()
    threads = [threading.Thread(target=one, args=(r,), name=str(r), daemon=True) for r in range(len(identities))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return results, time.monotonic() - started


def test_differences_names_both_torch_versions():
    theirs = dict(SAME, torch="2.13.0")
    line = differences(SAME, theirs, "rank 0", "rank 1")
    assert line == "different torch: rank 0 has 2.14.1, rank 1 has 2.13.0"
    assert differences(SAME, dict(SAME)) is None
    assert differences(SAME, dict(SAME, program="fedcba9876543210"), "rank 0", "rank 2") == (
        "different program (train.py and utils/): rank 0 has 0123456789abcdef, rank 2 has fedcba9876543210"
    )


@pytest.mark.timeout(60)
def test_alike_ranks_go_ahead(monkeypatch):
    results, _ = handshakes(monkeypatch, [SAME] * 3, [3, 3, 3])
    assert results == {0: "ok", 1: "ok", 2: "ok"}


@pytest.mark.timeout(60)
def test_a_different_torch_stops_both_sides_at_once(monkeypatch):
    results, seconds = handshakes(monkeypatch, [SAME, dict(SAME, torch="2.13.0")], [2, 2])
    line = "UsageError: different torch: rank 0 has 2.14.1, rank 1 has 2.13.0"
    assert results == {0: line, 1: line}
    assert seconds < distributed.ACK_WAIT  # rank 0 left once rank 1 had read its key, not at the wait's end


@pytest.mark.timeout(60)
def test_a_different_world_size_is_named_first(monkeypatch):
    results, _ = handshakes(monkeypatch, [SAME, dict(SAME, torch="2.13.0")], [2, 3])
    line = "UsageError: ranks were started with different --world-size: rank 0 has 2, rank 1 has 3"
    assert results == {0: line, 1: line}


@pytest.mark.timeout(60)
def test_a_rank_that_never_comes(monkeypatch):
    results, seconds = handshakes(monkeypatch, [SAME, SAME], [3, 3], seconds=0.5)
    assert results == {0: "PeerError: not every rank came", 1: "PeerError: not every rank came"}
    assert seconds < 10
