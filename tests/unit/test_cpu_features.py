"""engine.cpu: which units a CPU's flags mean, for the three CPUs the project has met."""

from pdserve.engine.cpu import CPUFeatures, cpu_features

EPYC_AVX2 = "fpu sse sse2 avx avx2 fma f16c"
XEON_VNNI = EPYC_AVX2 + " avx512f avx512bw avx512_vnni"
XEON_AMX = XEON_VNNI + " avx512_bf16 amx_tile amx_bf16 amx_int8"


def features(flags: str) -> CPUFeatures:
    return CPUFeatures("test CPU", frozenset(flags.split()))


def test_units_follow_the_flags():
    assert (features(EPYC_AVX2).bf16_units, features(EPYC_AVX2).int8_units) == (False, False)
    assert (features(XEON_VNNI).bf16_units, features(XEON_VNNI).int8_units) == (False, True)
    assert (features(XEON_AMX).bf16_units, features(XEON_AMX).int8_units) == (True, True)
    # the order engine/cpu.py reports them in, written out here (not read from it)
    want = "avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8"
    assert features(XEON_AMX).isa() == want.split()
    assert (
        features(EPYC_AVX2).describe()
        == "test CPU [avx2 fma f16c]; no native bf16 or int8 matrix units"
    )
    assert features(XEON_AMX).describe().endswith("native bf16 and int8 matrix units")


def test_this_machine_is_read():
    here = cpu_features()
    assert here.model and here is cpu_features()
    assert set(here.isa()) <= here.flags
