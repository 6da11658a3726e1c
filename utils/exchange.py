"""What ranks tell each other outside the gradients: JSON, or tensors by the weights-only loader.

Nothing a peer sends is unpickled: a pickle runs whatever code its sender chose. Every exchange is
two plain collectives over the default group, the lengths first, then the bytes:

    all_gather_json(value) -> [rank 0's, rank 1's, ...]     every rank a JSON value
    broadcast_json(value, src) -> src's value               src's JSON value to every rank
    all_gather_state(state) -> [rank 0's, rank 1's, ...]    dicts of tensors (torch.save)
    broadcast_state(state, src) -> src's state              src's dict of tensors to every rank

    int64 [len]               every rank's length (all_gather), or src's (broadcast)
    uint8 [longest] padded    the bytes: UTF-8 JSON, or a torch.save archive

    rank 0:  | 5 |  {"a":1}   ->  {"a": 1}
    rank 1:  | 3 |  [2]00000  ->  [2]

A JSON value comes back as JSON knows it: tuples as lists, dict keys as strings (the callers turn
them back). A state is read by torch.load(weights_only=True): tensors, dicts, lists, tuples and
plain numbers only; a class instance or any other global is refused. A peer's bytes that do not
decode are one PeerError line. The sender's own value comes back decoded too (a copy), as from
torch's *_object collectives.
"""

import io
import json
import re
import warnings

import torch
import torch.distributed as dist

from utils.errors import Outcome, PeerError, first_line

MAX_BYTES = 2**31  # a longer message is a peer gone wrong, not a state of this program


def all_gather_json(value):
    """Every rank's JSON value, in rank order (a collective)."""
    encoded = json.dumps(value).encode()
    return [decode_json(data, rank) for rank, data in enumerate(all_gather_bytes(encoded))]


def broadcast_json(value, src):
    """Rank `src`'s JSON value on every rank (a collective; other ranks' `value` is ignored)."""
    encoded = json.dumps(value).encode() if dist.get_rank() == src else b""
    return decode_json(broadcast_bytes(encoded, src), src)


def all_gather_state(state):
    """Every rank's dict of tensors (torch.save'd, read back weights-only), in rank order."""
    return [decode_state(data, rank) for rank, data in enumerate(all_gather_bytes(encode_state(state)))]


def broadcast_state(state, src):
    """Rank `src`'s dict of tensors on every rank; `src` keeps its own object, as broadcast_object_list does."""
    data = broadcast_bytes(encode_state(state) if dist.get_rank() == src else b"", src)
    return state if dist.get_rank() == src else decode_state(data, src)


def all_gather_bytes(data):
    """Every rank's bytes, in rank order: the lengths, then the bytes padded to the longest."""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64))
    lengths = [checked_length(size, rank) for rank, size in enumerate(sizes)]
    longest = max(1, *lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = [torch.empty(longest, dtype=torch.uint8) for _ in lengths]
    dist.all_gather(everyone, mine)
    return [bytes(buffer[:length].numpy()) for buffer, length in zip(everyone, lengths)]


def broadcast_bytes(data, src):
    """Rank `src`'s bytes on every rank: its length, then the bytes."""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src)
    length = checked_length(size, src)
    if dist.get_rank() == src:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(1, dtype=torch.uint8)
    else:
        buffer = torch.empty(max(1, length), dtype=torch.uint8)
    dist.broadcast(buffer, src)
    return bytes(buffer[:length].numpy())


def checked_length(size, rank):
    length = int(size.item())
    if not 0 <= length <= MAX_BYTES:
        raise PeerError(
            f"rank {rank} announced a message of {length} bytes; not this program's", Outcome.NOTHING_TO_RESUME
        )
    return length


def decode_json(data, rank):
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise PeerError(
            f"rank {rank} sent something that is not JSON ({first_line(e)})", Outcome.NOTHING_TO_RESUME
        ) from None


def encode_state(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def decode_state(data, rank):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # the weights-only loader refused it, or the bytes are no torch.save archive
        reason = re.search(r"Unsupported (global: GLOBAL \S+|[^\n.]*)", str(e))
        raise PeerError(
            f"rank {rank} sent a state the weights-only loader refused "
            f"({reason.group(0) if reason else first_line(e)})",
            Outcome.NOTHING_TO_RESUME,
        ) from None
