"""A row's product is the same bits alone as inside any batch (engine/layers/linear.py's
onednn_linear): oneDNN takes another kernel for one row at some shapes, and a decode step of one
sequence is one row, whose KV a later prefill of the same tokens (a conversation's next turn,
reusing it from the prefix cache) must match bit for bit. The down projection's shape of
SmolLM2 (1536 -> 576) is the one seen to differ (AMD EPYC AVX-512, float32)."""

from __future__ import annotations

import pytest
import torch

from helpers.marks import BF16_MODE
from pdserve.engine.cpu import cpu_features
from pdserve.engine.kernels import cpu_fused
from pdserve.engine.layers.linear import ReplicatedLinear

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize("mode", [None, BF16_MODE])
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (576, 576)])
def test_a_row_alone_gives_the_bits_it_gives_in_a_batch(shape, mode):
    k, n = shape
    g = torch.Generator().manual_seed(0)
    layer = ReplicatedLinear(k, n, bias=False)
    layer.weight.data.copy_(torch.randn(n, k, generator=g) * 0.05)
    layer.finalize(mode)
    x = torch.randn(64, k, generator=g)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(8)])
    # oneDNN's AMX bf16 kernel for 33 rows or more splits the sums otherwise than for fewer
    # (docs/engine.md): where its product is oneDNN's (no AMX product of ours for this process)
    # the bf16 mode is batch-invariant up to 32 rows a step only
    fused = cpu_fused()
    onednn_amx = (
        mode is not None
        and cpu_features().has("amx_bf16")
        and not (fused is not None and fused.amx_bf16_ready())
    )
    for rows in (2, 3, 8, 32) if onednn_amx else (2, 3, 8, 32, 64):
        assert torch.equal(layer(x[:rows])[:8], alone[: min(rows, 8)]), rows
