"""Optional compiled CPU kernels, built once per machine into the pdserve cache.

Everything here has a torch fallback in engine/attention.py and is tested against it; a machine
without a compiler (or with PDSERVE_CPU_KERNELS=0) just runs the fallback.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import pathlib
import subprocess

log = logging.getLogger(__name__)
_SRC = pathlib.Path(__file__).with_name("paged_decode_cpu.cpp")
_FUSED_SRC = pathlib.Path(__file__).with_name("fused_cpu.cpp")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


@functools.cache
def _ninja_version() -> str:
    """The version of the `ninja` torch's build runs (the first on PATH), "" where none runs."""
    try:
        done = subprocess.run(["ninja", "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def _build_key(source: pathlib.Path, extra_cflags: list[str]) -> str:
    """The cache entry a build of `source` goes to. -march=native: it is keyed by the CPU's
    feature flags and the source, so a cache directory shared by different machines never hands
    one a binary built for another; and by the flags. And by ninja's version: two ninjas keep
    logs in formats the other does not read (1.11's v5, 1.13's v7), so where a pip-installed ninja
    and the system's take turns (two PATH orders: a shell and a service, a venv and not) each
    rebuilt everything the other had built, a minute on two cores, at every start."""
    text = _cpu_flags() + source.read_text() + " ".join(extra_cflags) + _ninja_version()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _build(name: str, source: pathlib.Path, extra_cflags: list[str]):
    """The extension module compiled from `source` for this CPU (cached), or None (logged once)."""
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        from pdserve.engine.cpu import kernel_cflags

        # flags after -march=native: those of an emulated CPU kind (engine/cpu.py: run as avx2,
        # it builds the AVX2 paths on an AVX-512 machine), then PDSERVE_KERNEL_CFLAGS; the build is
        # keyed by them too
        extra_cflags = [
            *extra_cflags,
            *kernel_cflags(),
            *os.environ.get("PDSERVE_KERNEL_CFLAGS", "").split(),
        ]
        from pdserve.engine.loader import default_cache_dir, writable_dir

        key = _build_key(source, extra_cflags)
        # the real path, links resolved: torch's build file records the source's path (below),
        # and a cache reached through a link (as a test run reaches the developer's) must not
        # rebuild what the same cache reached directly has built
        build = (default_cache_dir() / "kernels").resolve() / key
        writable_dir(build)  # else a one-line CacheDirError, logged below: what to set
        # torch's own build lock is a plain file: a worker killed while compiling leaves it behind
        # and every later worker waits on it forever. An flock dies with its holder, so under it
        # any torch lock found is a dead one.
        with open(build / "pdserve.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (build / "lock").unlink(missing_ok=True)
            # Compile a copy kept beside the build: torch's build file records the source's path,
            # so two checkouts (or a venv and a checkout) with the same source would otherwise
            # rebuild each other's cache entry. Rewritten only when it differs (ninja sees mtimes).
            copy = build / source.name
            text = source.read_text()
            if not copy.exists() or copy.read_text() != text:
                copy.write_text(text)
            # -fopenmp: at::parallel_for is inline OpenMP; without it the kernel silently runs on
            # one thread
            return load(
                name=f"pdserve_{name}_{key}",
                sources=[str(copy)],
                extra_cflags=["-O3", "-march=native", "-fopenmp", *extra_cflags],
                extra_ldflags=["-fopenmp", "-lmvec"],
                build_directory=str(build),
                verbose=False,
            )
    except Exception as e:  # no compiler, no headers, no ninja: the torch path still works
        log.warning("pdserve: compiled CPU kernels %s unavailable (%s); using torch", name, e)
        return None


@functools.cache
def cpu_paged_decode():
    """The compiled `paged_decode(q, layer_kv, block_tables, context_lens, scale)`, or None.

    It needs head_dim to be a multiple of 16; `engine.attention.decode_kernel` checks that.
    """
    module = _cpu_paged_decode_module()
    return None if module is None else module.paged_decode


@functools.cache
def cpu_paged_decode_ex():
    """The compiled `paged_decode_ex(q, layer_kv, block_tables, context_lens, scale, window,
    softcap, sinks)` (window 0: the whole context; softcap 0: none; sinks an empty tensor: none,
    else each query head's sink logit, float32), or None."""
    module = _cpu_paged_decode_module()
    return None if module is None else module.paged_decode_ex


@functools.cache
def _cpu_paged_decode_module():
    # The kernel's prefetch of the next sequence's blocks (paged_decode_cpu.cpp Ahead) helped on
    # AMD's EPYC and slowed the Intel Xeon with AMX (where the hardware prefetchers do better
    # alone): built in where the CPU is AMD's only
    from pdserve.engine.cpu import cpu_features

    ahead = "AMD" in cpu_features().model
    return _build("paged_decode", _SRC, [f"-DPDSERVE_KV_AHEAD={int(ahead)}"])


def cpu_paged_decode_capsule():
    """The compiled paged decode kernel as a C function for other compiled code (the decode
    stack in fused_cpu.cpp), or None."""
    module = _cpu_paged_decode_module()
    return None if module is None else module.paged_decode_capsule


@functools.cache
def cpu_fused():
    """The compiled fused float32 ops (fused_cpu.cpp: add_rms_norm, rope_, int8_rows, q4_linear),
    or None. The layers use them for float32 CPU tensors and fall back to torch otherwise."""
    return _build("fused", _FUSED_SRC, ["-ffp-contract=off"])


def fused_for(t):
    """cpu_fused() when `t` is a float32 CPU tensor (what its ops take), else None."""
    import torch

    return cpu_fused() if t.device.type == "cpu" and t.dtype == torch.float32 else None
