"""TEMPORARY (replaced by the exchange helper's module): JSON over gloo, nothing unpickled."""

import json

import torch
import torch.distributed as dist


def all_gather_json(value):
    data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(data)]))
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(data)] = data
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(out, padded)
    return [json.loads(bytes(o[: int(s)].tolist())) for o, s in zip(out, sizes)]


def broadcast_json(value, src):
    return all_gather_json(value)[src]
