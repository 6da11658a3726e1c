"""Damage inside a tensor's bytes: what a bad disk or a bad copy does to a file, where neither the zip
archive nor the pickle notices (a truncated or random file is refused anyway: tests/world/test_bad_input.py)."""

import torch


def flip_inside(path, tensor, count=64):
    """Flip `count` bytes of `tensor` (contiguous) as torch.save stored them in the file at `path`:
    at the first 64 of its bytes, from its middle on, that occur in the file once. Returns the file's
    bytes before."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    with open(path, "rb") as f:
        data = f.read()
    for offset in range(len(raw) // 2 // 64 * 64, len(raw) - count, 64):
        window = raw[offset : offset + 64]
        if data.count(window) == 1:
            at = data.find(window)
            break
    else:
        raise AssertionError("no stretch of the tensor's bytes is in the file once")
    damaged = data[:at] + bytes(b ^ 0xFF for b in data[at : at + count]) + data[at + count :]
    with open(path, "wb") as f:
        f.write(damaged)
    return data
