"""utils/exchange.py over real gloo, 3 ranks on loopback (tests/support/exchange_worker.py): JSON and
states arrive whole on every rank, and what a peer could smuggle is refused, not unpickled."""

import os
import subprocess
import sys

import pytest
import torch

from utils.setup.launch import free_port, supervise

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
N = 3


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    folder, port = tmp_path_factory.mktemp("exchange"), free_port()
    outs, marker = [folder / f"rank{r}.pt" for r in range(N)], folder / "unpickled"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(HERE, "exchange_worker.py"),
                str(r),
                str(N),
                str(port),
                str(outs[r]),
                str(marker),
            ],
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(N)
    ]
    outcome = supervise(procs, timeout=90)  # kills every rank's group on the way out
    assert outcome.codes == [0] * N and not outcome.timed_out, [err for _, err in outcome.outputs]
    return [torch.load(o, weights_only=True) for o in outs], marker


def same(a, b):
    """Equal to the bit: tensors by their bytes (NaN, -0.0), containers by their items and types."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.view(-1).view(torch.uint8).equal(b.view(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.mark.timeout(120)
def test_json_arrives_as_json_knows_it(world):
    results, _ = world
    expected = [{"rank": r, "name": "é" * r, "steps": [21, 60], "keys": {"1": None}} for r in range(N)]
    for r in results:
        assert r["json"] == expected  # tuples as lists, int keys as strings: the callers turn them back
        assert r["empty"] == [""] * N
        assert r["broadcast"] == ["from", 1]


@pytest.mark.timeout(120)
def test_a_state_of_tensors_round_trips_bit_exactly(world):
    from exchange_worker import state_of

    results, _ = world
    for r in results:
        assert all(same(r["states"][k], state_of(k)) for k in range(N))
        assert same(r["broadcast_state"], state_of(2))
        assert r["none_state"] is None


@pytest.mark.timeout(120)
def test_what_a_peer_smuggles_is_refused_not_unpickled(world):
    results, marker = world
    assert not marker.exists()  # Smuggled.__reduce__ never ran
    for r in results:
        for what in ("smuggled", "instance"):
            assert r[what].startswith("rank 1 sent a state the weights-only loader refused (Unsupported global"), r
        assert "Plain" in r["instance"], r["instance"]
        assert "weights-only loader refused" in r["garbage_state"], r["garbage_state"]
        assert r["garbage_json"].startswith("rank 1 sent something that is not JSON"), r["garbage_json"]
        assert all("\n" not in r[k] for k in ("smuggled", "instance", "garbage_state", "garbage_json"))
