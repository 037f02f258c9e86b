"""What the CPU this process runs on offers, read once from /proc/cpuinfo.

The project's machines differ from one session to the next (an AMD EPYC with AVX-512 or with AVX2
only, Intel Xeons with AVX-512 VNNI, or with AMX and AVX512-BF16), and a path tuned on one can lose
on another. Hot paths ask `cpu_features()` rather than assume; the engine logs it once per process
(`log_once`), and every benchmark result records `describe()`.

Another CPU kind can be played on this one: `python -m benchmarks.as_cpu avx2 -- CMD` runs CMD
as if the CPU had only AVX2 (the AMD EPYC kind without AVX-512) or, with `avx512`, AVX-512 and
VNNI but no bf16 (the Intel Xeon kind without AMX). The flags above the kind are hidden from
`cpu_features()`, the compiled kernels build without those instructions, and torch's own
libraries (ATen, oneDNN, MKL) are capped by their documented variables, which must be set before
torch starts: that is why it wraps a whole command (its child processes, TP ranks and Ray
workers, inherit the variables). A process that has PDSERVE_CPU_AS without the libraries' caps
refuses to go on. The speed measured so is this CPU's cores on fewer instructions, not the other
machine's: it is for testing those paths and estimating, never for a CPU's row in BENCHMARKS.md.
"""

from __future__ import annotations

import functools
import logging
import os
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


# The kinds a process can be run as (PDSERVE_CPU_AS): the flags hidden from cpu_features (a prefix
# hides every flag that starts with it), the compiler flags the kernels build with, and the
# variables that cap torch's libraries (ATen's dispatch, oneDNN, MKL) to the same instructions.
EMULATED_KINDS = {
    "avx2": {
        "hidden": ("avx512", "amx", "avx_vnni"),
        "cflags": ("-mno-avx512f", "-mno-avxvnni", "-mno-amx-tile"),
        "env": {
            "ATEN_CPU_CAPABILITY": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        },
    },
    "avx512": {
        "hidden": ("avx512_bf16", "avx512_fp16", "amx"),
        "cflags": ("-mno-avx512bf16", "-mno-avx512fp16", "-mno-amx-tile"),
        "env": {
            "ATEN_CPU_CAPABILITY": "avx512",
            "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
            "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        },
    },
}


def emulated_kind() -> str | None:
    """The kind PDSERVE_CPU_AS names, or None; a ValueError for an unknown one, and a
    RuntimeError when torch's libraries were not capped with it (not run through `as`)."""
    kind = os.environ.get("PDSERVE_CPU_AS", "")
    if not kind:
        return None
    if kind not in EMULATED_KINDS:
        raise ValueError(f"PDSERVE_CPU_AS={kind!r}: expected one of {sorted(EMULATED_KINDS)}")
    missing = [
        f"{name}={value}"
        for name, value in EMULATED_KINDS[kind]["env"].items()
        if os.environ.get(name) != value
    ]
    if missing:
        raise RuntimeError(
            f"PDSERVE_CPU_AS={kind} without {' '.join(missing)}: torch would still use this "
            f"CPU's own instructions; run the command as `python -m benchmarks.as_cpu "
            f"{kind} -- CMD`"
        )
    return kind


def emulation_env(kind: str) -> dict[str, str]:
    """The variables that make a command run as `kind` (see the module docstring)."""
    if kind not in EMULATED_KINDS:
        raise ValueError(f"unknown CPU kind {kind!r}: expected one of {sorted(EMULATED_KINDS)}")
    return {"PDSERVE_CPU_AS": kind, **EMULATED_KINDS[kind]["env"]}


def kernel_cflags() -> list[str]:
    """Compiler flags that keep the compiled kernels within the emulated kind, if any."""
    kind = emulated_kind()
    return list(EMULATED_KINDS[kind]["cflags"]) if kind else []


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
    kind = emulated_kind()
    if kind is not None:
        hidden = EMULATED_KINDS[kind]["hidden"]
        flags = frozenset(f for f in flags if not f.startswith(hidden))
        model = f"{model} (run as {kind})"
    return CPUFeatures(model, flags)


@functools.cache
def log_once() -> CPUFeatures:
    """Logs this CPU's features the first time any engine in the process starts."""
    features = cpu_features()
    log.info("CPU: %s", features.describe())
    return features
