"""What the CPU this process runs on offers, read once from /proc/cpuinfo.

The project's machines differ from one session to the next (an AMD EPYC with AVX-512 or with AVX2
only, Intel Xeons with AVX-512 VNNI, or with AMX and AVX512-BF16), and a path tuned on one can lose
on another. Hot paths ask `cpu_features()` rather than assume; the engine logs it once per process
(`log_once`), and every benchmark result records `describe()`.
"""

from __future__ import annotations

import functools
import logging
import platform
from dataclasses import dataclass

log = logging.getLogger(__name__)

# the flags that decide a path, in the order they are reported
ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


@dataclass(frozen=True)
class CPUFeatures:
    model: str
    flags: frozenset[str]

    def has(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def bf16_units(self) -> bool:
        """Native bf16 matrix math (AMX-BF16 or AVX512-BF16): without them oneDNN emulates bf16,
        which is slower than float32."""
        return self.has("amx_bf16") or self.has("avx512_bf16")

    @property
    def int8_units(self) -> bool:
        """int8 dot products (AMX-INT8 or AVX512-VNNI) for dynamically quantized linears."""
        return self.has("amx_int8") or self.has("avx512_vnni")

    def isa(self) -> list[str]:
        return [f for f in ISA_FLAGS if f in self.flags]

    def describe(self) -> str:
        isa = " ".join(self.isa()) or "no AVX2"
        units = [
            name
            for name, present in (("bf16", self.bf16_units), ("int8", self.int8_units))
            if present
        ]
        return f"{self.model} [{isa}]; " + (
            f"native {' and '.join(units)} matrix units"
            if units
            else "no native bf16 or int8 matrix units"
        )


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:  # not Linux: no flags known, every path takes its portable branch
        pass
    return model or platform.processor() or "unknown CPU", flags


@functools.cache
def cpu_features() -> CPUFeatures:
    model, flags = _read_cpuinfo()
    return CPUFeatures(model, flags)


@functools.cache
def log_once() -> CPUFeatures:
    """Logs this CPU's features the first time any engine in the process starts."""
    features = cpu_features()
    log.info("CPU: %s", features.describe())
    return features
