"""Weights that are exactly 4-bit blocks (engine/layers/quant.py Q4Blocks, the compiled q4_linear
of engine/kernels/fused_cpu.cpp): found again in a float32 weight that a Q4_0 or Q4_1 GGUF
dequantized to, multiplied as float32 multiplies them, a row alone giving the bits it gives in any
batch, refused for any weight they would not rebuild exactly, and taken by the bf16 mode for steps
of at most Q4_ROWS rows (the decode stack included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.models import make_tiny_model, random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kernels import cpu_fused
from pdserve.engine.layers.linear import LinearBase
from pdserve.engine.layers.quant import Q4_ROWS, Bf16Weight, Q4Blocks

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(cpu_fused() is None, reason="no C++ toolchain: no compiled kernels"),
]
gguf = pytest.importorskip("gguf")


def as_stored(w: torch.Tensor, kind: str = "Q4_1") -> torch.Tensor:
    """`w` as a GGUF file of `kind` stores it, dequantized as the model loader does."""
    from gguf.quants import dequantize, quantize

    t = getattr(gguf.GGMLQuantizationType, kind)
    a = w.float().numpy()
    return torch.from_numpy(np.ascontiguousarray(dequantize(quantize(a, t), t).reshape(a.shape)))


def weight(out=96, inp=160, seed=0, kind="Q4_1") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return as_stored(torch.randn(out, inp, generator=g) * 0.05, kind)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_a_gguf_4_bit_weight_multiplies_as_float32(kind):
    w = weight(kind=kind)
    blocks = Q4Blocks.of(w)
    assert blocks is not None
    assert blocks.blocks.shape == (96, 160 // 32 * 20) and blocks.blocks.dtype == torch.uint8
    x = torch.randn(13, 160, generator=torch.Generator().manual_seed(1))
    y = blocks.matmul(x)
    exact = (x.double() @ w.double().T).float()
    # float32's rounding of the same products, summed in another order
    torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-6)


def test_a_row_gives_the_same_bits_alone_as_in_any_batch():
    blocks = Q4Blocks.of(weight())
    x = torch.randn(20, 160, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([blocks.matmul(x[i : i + 1]) for i in range(20)])
    for rows in (2, 7, 8, 9, 16, 20):  # the kernel serves rows 8 at a time
        assert torch.equal(blocks.matmul(x[:rows]), alone[:rows]), rows
    wide = torch.randn(20, 320, generator=torch.Generator().manual_seed(3))
    narrowed = wide[:, :160]  # rows 320 apart
    assert torch.equal(blocks.matmul(narrowed), blocks.matmul(narrowed.clone()))


def test_a_weight_that_is_not_4_bit_blocks_is_refused():
    g = torch.Generator().manual_seed(3)
    assert Q4Blocks.of(torch.randn(64, 64, generator=g)) is None  # plain float32
    assert Q4Blocks.of(weight(inp=48 * 2)[:, :48].contiguous()) is None  # 48 inputs: no blocks
    assert Q4Blocks.of(weight().to(torch.bfloat16)) is None
    w = weight()
    w[5, 37] = torch.nextafter(w[5, 37], torch.tensor(1.0))  # one weight one step off
    assert Q4Blocks.of(w) is None
    w = weight()
    w[0, :32] = w[0, 0]  # a constant block is d = 0, q = 0: still exact
    assert Q4Blocks.of(w) is not None
    w[1, 3] = float("nan")
    assert Q4Blocks.of(w) is None


def test_the_bf16_mode_takes_the_blocks_for_steps_of_few_rows():
    w = weight()
    bf16 = Bf16Weight(w)
    assert bf16.q4 is not None
    x = torch.randn(Q4_ROWS + 1, 160, generator=torch.Generator().manual_seed(4))
    assert torch.equal(bf16.matmul(x[:Q4_ROWS]), bf16.q4.matmul(x[:Q4_ROWS]))
    assert torch.equal(bf16.matmul(x), bf16.dense_matmul(x))
    assert not torch.equal(bf16.dense_matmul(x[:1]), bf16.q4.matmul(x[:1]))  # two arithmetics
    assert Bf16Weight(torch.randn(96, 160)).q4 is None


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory):
    """A tiny Llama whose decoder linears are stored as a Q4_1 GGUF would store them."""
    path = tmp_path_factory.mktemp("q4-llama")
    make_tiny_model(path, "llama-gqa", seed=5)
    file = next(path.glob("*.safetensors"))
    tensors = load_file(file)
    for name, t in tensors.items():
        if name.endswith("proj.weight"):
            tensors[name] = as_stored(t)
    save_file(tensors, file, metadata={"format": "pt"})
    return str(path)


def test_the_decode_stack_takes_the_blocks_and_gives_the_layer_by_layer_bits(q4_model):
    llm = LLM(  # no prefix cache: the second run must prefill exactly as the first did
        q4_model,
        dtype="float32",
        quantization="bf16",
        kv_cache_memory=1 << 22,
        enable_prefix_caching=False,
    )
    model = llm.engine.runner.model
    try:
        decoder = [
            m._quant
            for name, m in model.named_modules()
            if isinstance(m, LinearBase) and ".layers." in name
        ]
        assert decoder and all(isinstance(q, Bf16Weight) and q.q4 is not None for q in decoder)
        stack = model.model._stack
        assert stack is not None
        prompts = random_prompts([5, 17, 40], seed=6)
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=True)

        def run():
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

        fused = run()
        model.model._stack = None
        try:
            layer_by_layer = run()
        finally:
            model.model._stack = stack
        assert fused == layer_by_layer
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
