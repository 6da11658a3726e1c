"""One rank of tests/world/test_exchange.py: utils/exchange.py over real gloo, and what it refuses."""

import datetime
import io
import pathlib
import sys

import torch
import torch.distributed as dist

from utils import exchange
from utils.errors import PeerError


class Plain:
    """Any class instance: the weights-only loader knows no class but torch's own."""


class Smuggled:
    """What a peer could hide in a pickle: unpickling it would create the file MARKER."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def state_of(rank):
    """A dict of tensors as the checkpoint and the compression states hold them: odd dtypes and
    values (-0.0, NaN, subnormals), int keys, tuples, None, a view sharing its storage."""
    g = torch.Generator().manual_seed(rank)
    base = torch.randn(40, generator=g)
    base[:3] = torch.tensor([-0.0, float("nan"), 1e-45])
    return {
        "floats": base,
        "view": base[10:20],
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "ints": torch.randint(-(2**62), 2**62, (5,), generator=g, dtype=torch.int64),
        "flags": torch.rand(6, generator=g) > 0.5,
        "scales": {0: 2.0**-rank, 3: 0.5},
        "position": (rank, 7),
        "nothing": None,
        "rng": g.get_state(),
    }


def refused(send, decode):
    """Rank 1 sends `send` (bytes) as every rank's message; what each rank's decoder says of it."""
    everyone = exchange.all_gather_bytes(send if dist.get_rank() == 1 else b"null")
    try:
        decode(everyone[1], 1)
    except PeerError as e:
        return str(e)
    return "accepted"


def main(rank, world_size, port, out, marker):
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=30),
    )
    results = {
        "json": exchange.all_gather_json({"rank": rank, "name": "é" * rank, "steps": (21, 60), "keys": {1: None}}),
        "empty": exchange.all_gather_json(""),
        "broadcast": exchange.broadcast_json(["from", rank] if rank == 1 else None, src=1),
        "states": exchange.all_gather_state(state_of(rank)),
        "broadcast_state": exchange.broadcast_state(state_of(rank) if rank == 2 else None, src=2),
        "none_state": exchange.broadcast_state(None, src=0),
    }
    smuggled = io.BytesIO()
    torch.save({"model": torch.ones(2), "extra": Smuggled(marker)}, smuggled)
    results["smuggled"] = refused(smuggled.getvalue(), exchange.decode_state)
    plain = io.BytesIO()
    torch.save({"model": torch.ones(2), "extra": Plain()}, plain)
    results["instance"] = refused(plain.getvalue(), exchange.decode_state)
    results["garbage_state"] = refused(b"\x80\x02garbage", exchange.decode_state)
    results["garbage_json"] = refused(b"\xff{not json", exchange.decode_json)
    torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
