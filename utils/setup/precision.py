"""--precision: the dtype of the forward and backward passes, and whether this CPU has it.

    fp32   (default) every sum in float32
    bf16   the convolutions and matrix products in bfloat16 (torch.autocast), on CPUs with native
           bf16 dot products: AVX-512-BF16 (AMD Zen 4 and later, Intel Cooper Lake and later) or
           AMX (Intel Sapphire Rapids and later). The weights, their gradients, the ring's sum and
           Adam stay float32; elsewhere oneDNN would emulate bf16 and run slower than float32.

Torch-free, so the launcher checks every rank's setting before it loads torch.
"""

PRECISIONS = ("fp32", "bf16")
# /proc/cpuinfo's names of the units each precision needs (any one of them); fp32: none
NEEDS = {"fp32": (), "bf16": ("avx512_bf16", "amx_bf16")}


def cpu_flags(cpuinfo: str) -> set[str]:
    """The CPU's feature flags, from the text of /proc/cpuinfo (its first 'flags' line)."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def refusal(precision: str, flags: set[str]) -> str | None:
    """Why this CPU cannot train in `precision`, in one line; None if it can."""
    if NEEDS[precision] and not flags & set(NEEDS[precision]):
        return f"--precision {precision} needs a CPU with AVX-512-BF16 or AMX (/proc/cpuinfo lists neither); use fp32"
    return None


def this_cpu() -> set[str]:
    """This machine's CPU flags (none where /proc/cpuinfo is missing: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return cpu_flags(f.read())
    except OSError:
        return set()
