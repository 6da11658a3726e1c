"""glibc's malloc, told to keep the memory a training step frees for the next step.

A step allocates and frees the same buffers every time (this CNN's activations at 56 images a
step: about 20 MB). glibc's malloc hands buffers over 128 KB back to the kernel when they are
freed, until its own rule raises that limit from the sizes it sees; when a rank's batch changes
size (--balance moves its share), and sometimes even at one size, the limits settle where every
step gets its buffers from the kernel again: thousands of fresh pages, each faulted in and zeroed.
Measured here (bench/README.md): a rank at 56 images a step after 10 steps at 32 took 24-30 ms a
step with 2,700-5,500 page faults, against 19-20 ms and none with the limits below.

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
