"""Markers for tests that need something only some CPUs have.

`needs_onednn_bf16`: the bf16 mode (quantization="bf16") and anything else that packs bf16 weights
for oneDNN; torch refuses that on a CPU with AVX2 only (engine/layers/quant.py
onednn_bf16_available). `BF16_MODE` is the "bf16" value of a mode parametrization, so marked.
`python -m benchmarks.as_cpu avx2 -- bash scripts/test.sh tests/unit` runs the lane as such a
CPU would."""

from __future__ import annotations

import pytest

from pdserve.engine.layers.quant import onednn_bf16_available

needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_bf16_available(), reason="oneDNN's bf16 linear does not run on this CPU"
)
BF16_MODE = pytest.param("bf16", marks=needs_onednn_bf16)
