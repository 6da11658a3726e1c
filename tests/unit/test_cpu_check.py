"""--precision's check of the CPU, fed the text of /proc/cpuinfo of CPUs with and without bf16 units."""

from utils.setup.precision import cpu_flags, refusal, this_cpu

ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma bmi2\nbogomips\t: 5000\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n"


def test_the_flags_line_is_read():
    assert cpu_flags(ZEN3) == {"fpu", "sse2", "avx", "avx2", "fma", "bmi2"}
    assert cpu_flags("processor : 0\n") == set()


def test_bf16_is_refused_on_a_cpu_without_its_units_in_one_line():
    why = refusal("bf16", cpu_flags(ZEN3))
    assert why is not None and "\n" not in why
    assert "--precision bf16 needs a CPU with AVX-512-BF16 or AMX" in why
    assert refusal("bf16", set()) == why  # no /proc/cpuinfo: refused the same way


def test_bf16_is_taken_with_avx512_bf16_or_amx_and_fp32_everywhere():
    assert refusal("bf16", cpu_flags(ZEN4)) is None
    assert refusal("bf16", cpu_flags(SAPPHIRE_RAPIDS)) is None
    assert refusal("fp32", cpu_flags(ZEN3)) is None
    assert refusal("fp32", set()) is None


def test_this_machine_is_read():
    """This machine's /proc/cpuinfo is read, and bf16 is allowed exactly when it lists a bf16 unit. The
    fleet has both kinds (Zen 4/5 and Sapphire Rapids with them, Zen 2 without): the bf16 tests train
    where bf16 is allowed and check its refusal elsewhere."""
    flags = this_cpu()
    assert {"fpu", "sse2"} <= flags, sorted(flags)
    assert (refusal("bf16", flags) is None) == bool(flags & {"avx512_bf16", "amx_bf16"}), sorted(flags)
