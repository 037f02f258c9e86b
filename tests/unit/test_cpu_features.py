"""engine.cpu: which units a CPU's flags mean, for the three CPUs the project has met."""

import pytest

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


def test_a_process_run_as_another_kind_sees_only_its_flags(monkeypatch):
    """benchmarks/as_cpu.py: the kind's flags hidden from cpu_features, its compiler flags for the
    kernels, and its run refused unless torch's libraries were capped the same way."""
    import pdserve.engine.cpu as cpu

    monkeypatch.setattr(cpu, "_read_cpuinfo", lambda: ("test CPU", frozenset(XEON_AMX.split())))
    for kind, isa in (
        ("avx2", "avx2 fma f16c"),
        ("avx512", "avx2 fma f16c avx512f avx512bw avx512_vnni"),
    ):
        for name, value in cpu.emulation_env(kind).items():
            monkeypatch.setenv(name, value)
        cpu.cpu_features.cache_clear()
        seen = cpu.cpu_features()
        assert seen.isa() == isa.split()
        assert seen.model == f"test CPU (run as {kind})"
        assert cpu.kernel_cflags() and all(f.startswith("-mno-") for f in cpu.kernel_cflags())
    assert not cpu.cpu_features().bf16_units and cpu.cpu_features().int8_units
    # PDSERVE_CPU_AS alone: torch would run the machine's own instructions
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    cpu.cpu_features.cache_clear()
    with pytest.raises(RuntimeError, match="ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI"):
        cpu.cpu_features()
    monkeypatch.setenv("PDSERVE_CPU_AS", "sse2")
    with pytest.raises(ValueError, match="'avx2', 'avx512'"):
        cpu.emulated_kind()
    monkeypatch.delenv("PDSERVE_CPU_AS")
    cpu.cpu_features.cache_clear()
    assert cpu.cpu_features().isa() == XEON_AMX.replace("fpu sse sse2 avx ", "").split()
    assert cpu.kernel_cflags() == []
    cpu.cpu_features.cache_clear()
