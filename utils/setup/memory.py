"""glibc's malloc, told to keep the memory a training step frees for the next step.

A step allocates and frees the same buffers every time (this CNN's activations and gradients).
glibc's malloc hands buffers over its mmap threshold back to the kernel when they are freed, and
trims its heap's top past its trim threshold; it moves both limits by the sizes it sees, and for a
training step they settle, in most runs, where every step gets fresh pages from the kernel:
thousands of them, each faulted in and zeroed. With the fixed limits below the freed buffers stay
for the next step (the page faults and the step's time measured: bench/balance/NOTES.md, "glibc's
malloc limits").

Fixed limits also turn glibc's own rule off. Only where the buffers live changes, never what is
computed: torch aligns its buffers alike either way, so the bits stay the same.
"""

import ctypes

M_TRIM_THRESHOLD = -1  # (mallopt's parameter numbers, from glibc's malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # buffers up to this size come from the heap (glibc's largest allowed on 64 bits)
TRIM_THRESHOLD = 128 << 20  # the heap keeps up to this much free memory at its top


def keep_freed_memory():
    """Set the limits (on glibc; elsewhere nothing to do). True if they were set. The processes this
    one forks inherit them; a rank started afresh sets its own."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc: musl, macOS
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
