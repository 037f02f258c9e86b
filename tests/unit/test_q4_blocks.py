"""Weights that are exactly 4-bit blocks (engine/layers/quant.py Q4Blocks, the compiled q4_linear
and q4_linear_f32 of engine/kernels/fused_cpu.cpp): found again in a float32 weight that a Q4_0 or
Q4_1 GGUF dequantized to, multiplied bit for bit as oneDNN's bf16 linear and its float32 linear
multiply the same weight (and as references written here without either kernel), a row alone
giving the bits it gives in any batch, refused for any weight they would not rebuild exactly, and
taken by the bf16 mode and the float32 mode for steps of at most Q4_ROWS rows (the decode stack
included): greedy tokens and logprobs the same for a sequence alone as in a batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.marks import needs_onednn_bf16
from helpers.models import make_tiny_model, random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.cpu import CPUFeatures, cpu_features
from pdserve.engine.kernels import cpu_fused
from pdserve.engine.layers.linear import LinearBase
from pdserve.engine.layers.quant import (
    Q4_ROWS,
    Bf16Weight,
    Q4Blocks,
    Q8Blocks,
    cancelling_rows,
    exact_blocks,
    float32_block_rows,
    onednn_part,
    q4_gives_onednn_bits,
    tile_rows,
)

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


def reference(x: torch.Tensor, w: torch.Tensor, part: int) -> torch.Tensor:
    """oneDNN's bf16 arithmetic in plain float32 torch ops: x and w rounded to bf16, each
    output's products (exact in float32) summed pair after pair in input order, the odd input's
    first, in parts of `part` inputs added in order, the sum rounded to bf16. A negative part:
    the tiles' order (AMX) in parts of -part, each block of 32 inputs summed from zero in two
    chains, the even inputs' and the odd inputs', their sum added to the part's."""
    xb, wb = x.to(torch.bfloat16).float(), w.to(torch.bfloat16).float()
    tiles, part = part < 0, abs(part)
    total = None
    for lo in range(0, x.shape[1], part):
        acc = torch.zeros(x.shape[0], w.shape[0])
        for b in range(lo, min(lo + part, x.shape[1]), 32 if tiles else 2):
            if not tiles:
                acc = acc + xb[:, b + 1 : b + 2] * wb[:, b + 1]
                acc = acc + xb[:, b : b + 1] * wb[:, b]
                continue
            even = odd = torch.zeros_like(acc)
            for k in range(b, b + 32, 2):
                even = even + xb[:, k : k + 1] * wb[:, k]
                odd = odd + xb[:, k + 1 : k + 2] * wb[:, k + 1]
            acc = acc + (even + odd)
        total = acc if total is None else total + acc
    return total.to(torch.bfloat16)


def reference_f32(x: torch.Tensor, w: torch.Tensor, part: int) -> torch.Tensor:
    """oneDNN's float32 arithmetic without it: each output one chain of fused multiply-adds in
    input order (the product and sum carried in 80-bit long double, then rounded to float32:
    a float32 product is exact there, so each step rounds once as an FMA does, unless the sum
    needs more than 64 bits, which these magnitudes never reach), in parts added in order."""
    xs, ws = x.double().numpy().astype(np.longdouble), w.double().numpy().astype(np.longdouble)
    total = None
    for lo in range(0, x.shape[1], part):
        acc = np.zeros((x.shape[0], w.shape[0]), dtype=np.float32)
        for k in range(lo, min(lo + part, x.shape[1])):
            step = acc.astype(np.longdouble) + xs[:, k : k + 1] * ws[:, k]
            acc = step.astype(np.float32)
        total = acc if total is None else (total + acc).astype(np.float32)
    return torch.from_numpy(total)


def dense_f32(w: torch.Tensor):
    """The float32 linear's own product (engine/layers/linear.py: oneDNN on the packed weight)."""
    from pdserve.engine.layers.linear import onednn_linear

    packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
    return lambda x: onednn_linear(x, packed, None)


@pytest.mark.parametrize("inp", [160, 576, 1536])
def test_a_gguf_4_bit_weight_multiplies_as_onednn_float32_does(inp):
    """The float32 mode's product: oneDNN's bits, the reference's bits, float32's values."""
    w = weight(out=32, inp=inp, seed=inp)
    q4 = Q4Blocks.of(w, torch.float32)
    assert q4 is not None and q4.dtype == torch.float32
    assert q4_gives_onednn_bits(inp, 32, q4.part, torch.float32)
    x = torch.randn(13, inp, generator=torch.Generator().manual_seed(1))
    y = torch.cat([q4.matmul(c) for c in x.split(Q4_ROWS)])
    assert y.dtype == torch.float32
    assert torch.equal(y, dense_f32(w)(x))
    assert torch.equal(y, reference_f32(x, w, q4.part))
    alone = torch.cat([q4.matmul(x[i : i + 1]) for i in range(13)])
    assert torch.equal(alone, y)
    for other in {512, 1024, inp} - {q4.part}:  # another order of the sums is told apart
        if other >= inp and q4.part >= inp:
            continue
        assert not q4_gives_onednn_bits(inp, 32, other, torch.float32), other


def test_a_gguf_8_bit_weight_multiplies_as_onednn_float32_does():
    """Q8_0 blocks (d * q): found, multiplied to oneDNN's float32 bits and the reference's, a
    row alone as in a batch; refused where a weight is one step off; only for float32."""
    w = weight(out=48, inp=576, seed=12, kind="Q8_0")
    assert Q4Blocks.of(w, torch.float32) is None
    q8 = Q8Blocks.of(w)
    assert q8 is not None and q8.blocks.shape == (48 // 16, 576 // 32 * 544)
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(2))
    y = torch.cat([q8.matmul(c) for c in x.split(Q4_ROWS)])
    assert torch.equal(y, dense_f32(w)(x))
    assert torch.equal(y, reference_f32(x, w, q8.part))
    assert torch.equal(torch.cat([q8.matmul(x[i : i + 1]) for i in range(11)]), y)
    assert isinstance(exact_blocks(w, torch.float32, dense_f32(w)), Q8Blocks)
    assert exact_blocks(w, torch.bfloat16, lambda x: None) is None  # no 8-bit bf16 product
    w[7, 100] = torch.nextafter(w[7, 100], torch.tensor(1.0))
    assert Q8Blocks.of(w) is None
    assert Q8Blocks.of(torch.randn(48, 576)) is None


def test_blocks_whose_product_misses_onednns_bits_are_refused(monkeypatch):
    """exact_blocks checks the product against the dense one before use: with a wrong part
    (another CPU's oneDNN) the float32 mode warns and keeps the dense weight."""
    import pdserve.engine.layers.quant as quant

    w = weight(out=32, inp=576, seed=13, kind="Q8_0")
    monkeypatch.setattr(quant, "onednn_part", lambda inp, out=16, dtype=None: 32)
    with pytest.warns(UserWarning, match="8-bit product does not give oneDNN's float32 bits"):
        assert exact_blocks(w, torch.float32, dense_f32(w)) is None


@pytest.mark.parametrize(("kind", "inp"), [("Q4_1", 576), ("Q4_1", 1536), ("Q8_0", 576)])
def test_float32_blocks_give_onednns_bits_at_every_step_size(kind, inp):
    """The float32 product over blocks, however many rows a step has (the kernel serves few rows
    in passes of its own, more over each block's (AVX2: group's) weights decoded once, in chunks
    of rows and tiles of three groups; where each begins and ends differs with the count):
    oneDNN's bits for the batch, and each row's bits alone. 80 outputs: a tile of three groups
    and one of two."""
    w = weight(out=80, inp=inp, seed=inp + 1, kind=kind)
    blocks = Q4Blocks.of(w, torch.float32) if kind == "Q4_1" else Q8Blocks.of(w)
    assert blocks is not None
    x = torch.randn(130, inp, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([blocks.matmul(x[i : i + 1]) for i in range(len(x))])
    for rows in (5, 8, 13, 32, 47, 130):
        got = blocks.matmul(x[:rows])
        assert torch.equal(got, dense_f32(w)(x[:rows])), rows
        assert torch.equal(got, alone[:rows]), rows


@needs_onednn_bf16
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_a_gguf_4_bit_weight_multiplies_as_onednn_bf16_does(kind):
    w = weight(kind=kind)
    blocks = Q4Blocks.of(w)
    assert blocks is not None
    assert blocks.blocks.shape == (96 // 16, 160 // 32 * 320) and blocks.blocks.dtype == torch.uint8
    x = torch.randn(13, 160, generator=torch.Generator().manual_seed(1))
    y = blocks.matmul(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, reference(x, w, blocks.part).float())
    assert torch.equal(y, Bf16Weight(w).dense_matmul(x))
    torch.testing.assert_close(y, x @ w.T, rtol=2e-2, atol=2e-2)  # bf16's rounding of float32's


@needs_onednn_bf16
@pytest.mark.parametrize("inp", [160, 576, 1536, 2560])
def test_the_parts_measured_on_onednn_give_its_bits(inp):
    """onednn_part measures how oneDNN splits a row's sum on this CPU; with it the 4-bit
    product gives oneDNN's bits on rows built to expose the order of the sums, and with any other
    part it does not (so Bf16Weight's check can fail). The reference above, which uses neither
    kernel, gives the same bits."""
    part = onednn_part(inp, 32)
    assert part is not None
    assert q4_gives_onednn_bits(inp, 32, part)
    for other in {32, 64, 512, 1024, 2048} - {part}:
        if other >= inp and part == inp:
            continue  # one part either way
        assert not q4_gives_onednn_bits(inp, 32, other), other
    if part < 0:  # the tiles' order (AMX): pairs in order, and other parts of it, told apart
        for other in {-64, -(inp // 2) // 32 * 32} - {part}:
            assert not q4_gives_onednn_bits(inp, 32, other), other
    ones = torch.ones(32, inp)
    x = cancelling_rows(inp)
    assert torch.equal(reference(x, ones, part).float(), Bf16Weight(ones).dense_matmul(x))
    w = weight(out=32, inp=inp, seed=inp)  # and a GGUF-like weight on random rows
    x = torch.randn(64, inp, generator=torch.Generator().manual_seed(inp))
    assert torch.equal(Q4Blocks.of(w).matmul(x), Bf16Weight(w).dense_matmul(x))


@pytest.mark.parametrize("part", [-160, -64])
def test_the_tiles_order_is_the_references_on_any_cpu(part):
    """q4_linear's tiles' order (a negative part: oneDNN's AMX order), checked against the
    reference on every CPU, on random rows and on rows that tell the orders apart."""
    w = weight(out=32, inp=160, seed=5)
    blocks = cpu_fused().q4_blocks(w)
    x = torch.randn(13, 160, generator=torch.Generator().manual_seed(5)) * 3
    x = torch.cat([x, tile_rows(160), cancelling_rows(160)])
    y = torch.cat([cpu_fused().q4_linear(c, blocks, part) for c in x.split(Q4_ROWS)])
    assert torch.equal(y, reference(x, w, part))
    assert not torch.equal(y, reference(x, w, -part))  # pairs in order: other bits
    ones = torch.ones(32, 160)
    y = cpu_fused().q4_linear(tile_rows(160), cpu_fused().q4_blocks(ones), part)
    assert y[:2, 0].tolist() == [0.0, 1.0]  # the tiles' two chains, whatever the parts


@needs_onednn_bf16
def test_a_row_gives_the_same_bits_alone_as_in_any_batch():
    blocks = Q4Blocks.of(weight())
    x = torch.randn(20, 160, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([blocks.matmul(x[i : i + 1]) for i in range(20)])
    for rows in (2, 7, 8, 9, 16, 20):  # the kernel serves rows 8 at a time
        assert torch.equal(blocks.matmul(x[:rows]), alone[:rows]), rows
    wide = torch.randn(20, 320, generator=torch.Generator().manual_seed(3))
    narrowed = wide[:, :160]  # rows 320 apart
    assert torch.equal(blocks.matmul(narrowed), blocks.matmul(narrowed.clone()))


def test_without_avx512_the_blocks_take_every_step_and_oneDNN_keeps_no_copy(monkeypatch):
    """Where the dense float32 product would be oneDNN's AVX2 kernel, the blocks lead at every
    step size (measured: quant.BLOCKS_EVERY_STEP), so a float32 layer with blocks and no bias
    drops its oneDNN copy and multiplies a prompt's many rows with its blocks too; with AVX-512
    the blocks take up to Q4_ROWS rows and the copy stays, as it does for a layer with a bias.
    (Our own AVX-512 product, which replaces oneDNN's copy where this machine's kernel gives its
    bits, is left out: it follows the real CPU, not the flags played here.)"""
    import pdserve.engine.layers.linear as linear
    import pdserve.engine.layers.quant as quant

    monkeypatch.setattr(linear, "own_product", lambda *args: (None, 0))
    w = weight(out=64, inp=160)
    x = torch.randn(300, 160, generator=torch.Generator().manual_seed(4))
    blocks = Q4Blocks.of(w, torch.float32)
    assert blocks is not None
    for flags, rows, copy in (
        (["avx2", "fma"], quant.BLOCKS_EVERY_STEP, False),
        (["avx512f"], Q4_ROWS, True),
        (["avx512f", "amx_bf16"], quant.AMX_FLOAT32_BLOCK_ROWS, True),
    ):
        monkeypatch.setattr(
            quant, "cpu_features", lambda f=flags: CPUFeatures("test", frozenset(f))
        )
        assert float32_block_rows() == rows
        for bias in (False, True):
            layer = linear.ReplicatedLinear(160, 64, bias=bias)
            layer.weight.data.copy_(w)
            if bias:
                layer.bias.data.zero_()
            layer.finalize()
            assert layer._blocks is not None and layer.weight.numel() == 0
            assert (layer._packed is not None) == (copy or bias), (flags, bias)
            y = layer(x)
            if not copy and not bias:  # every step the blocks' bits, 300 rows as 1
                assert torch.equal(y, blocks.matmul(x))
                assert torch.equal(layer(x[:1]), y[:1])
            torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)


@needs_onednn_bf16
def test_a_weight_that_is_not_4_bit_blocks_is_refused():
    g = torch.Generator().manual_seed(3)
    assert Q4Blocks.of(torch.randn(64, 64, generator=g)) is None  # plain float32
    assert Q4Blocks.of(weight(out=24)) is None  # outputs not in groups of 16
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


@pytest.fixture
def no_amx_blocks(monkeypatch):
    """The bf16 mode's blocks as every CPU without AMX takes them (Q4Blocks for steps of few
    rows), on the AMX Xeon too, where they would otherwise take every step on the tiles
    (quant.amx_blocks; tested below)."""
    import pdserve.engine.layers.quant as quant

    monkeypatch.setattr(quant, "amx_blocks", lambda weight, packed: None)


@needs_onednn_bf16
@pytest.mark.usefixtures("no_amx_blocks")
def test_the_bf16_mode_takes_the_blocks_for_steps_of_few_rows():
    w = weight()
    bf16 = Bf16Weight(w)
    assert bf16.q4 is not None
    x = torch.randn(2 * Q4_ROWS, 160, generator=torch.Generator().manual_seed(4))
    assert torch.equal(bf16.matmul(x[:Q4_ROWS]), bf16.q4.matmul(x[:Q4_ROWS]))
    assert torch.equal(bf16.matmul(x), bf16.dense_matmul(x))
    # the same bits either way, one row or many
    assert torch.equal(bf16.q4.matmul(x[:1]), bf16.dense_matmul(x[:1]))
    assert torch.equal(bf16.matmul(x[:Q4_ROWS]), bf16.matmul(x)[:Q4_ROWS])
    assert Bf16Weight(torch.randn(96, 160)).q4 is None


@needs_onednn_bf16
def test_the_bf16_mode_refuses_blocks_that_do_not_give_onednn_bits(monkeypatch):
    """Where the measured part does not reproduce oneDNN (another CPU's kernel), the check at
    load refuses the blocks, with a warning: the bf16 weight serves every step."""
    import pdserve.engine.layers.quant as quant

    monkeypatch.setattr(quant, "onednn_part", lambda inp, out=16, dtype=None: 32)
    w = weight(out=32, inp=576, seed=9)
    assert Q4Blocks.of(w) is not None
    with pytest.warns(UserWarning, match="4-bit product does not give oneDNN's bf16 bits"):
        assert Bf16Weight(w).q4 is None


def without_stack(model, run):
    """run()'s result with the model's decode stack off: its layers one by one."""
    stack = model.model._stack
    model.model._stack = None
    try:
        return run()
    finally:
        model.model._stack = stack


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
        elif name in ("lm_head.weight", "model.embed_tokens.weight"):
            tensors[name] = as_stored(t, "Q8_0")  # as SmolLM2's GGUF stores its embedding
    save_file(tensors, file, metadata={"format": "pt"})
    return str(path)


amx_tiles = pytest.mark.skipif(
    cpu_fused() is None or not cpu_features().has("amx_bf16") or not cpu_fused().amx_bf16_ready(),
    reason="needs AMX's bf16 tiles",
)


@amx_tiles
@pytest.mark.parametrize(
    "kind, dtype", [("Q4_1", torch.uint8), ("Q4_0", torch.uint8), ("Q8_0", torch.int8)]
)
def test_on_amx_the_blocks_take_every_step_with_amx_linears_bits(kind, dtype):
    """Where the tiles multiply the bf16 mode (amx_product), a weight that is exactly 4- or 8-bit
    blocks is multiplied from them rebuilt in L1 (amx_q4_linear, amx_q8_linear): amx_linear's
    bits at every step size, through each path (one chunk, narrow passes, row blocks), so a
    row's bits do not depend on its step; no bf16 copy is kept. The screened head (SmolLM2's is
    Q8_0) screens with the float32 sums amx_linear would give."""
    from pdserve.engine.layers.quant import ScreenedHead

    fused = cpu_fused()
    w = weight(out=64, inp=576, seed=12, kind=kind)
    bf16 = Bf16Weight(w)
    assert bf16.q4 is None and bf16.packed is None and bf16.bp.dtype == dtype
    packed = fused.amx_pack(w)
    head = ScreenedHead(w, screen="bf16")
    x = torch.randn(600, 576, generator=torch.Generator().manual_seed(13))
    for rows in (1, 5, 16, 17, 32, 33, 47, 80, 81, 130, 600):
        got = bf16.matmul(x[:rows])
        assert torch.equal(got, fused.amx_linear(x[:rows], packed).float()), rows
        assert torch.equal(got[:1], bf16.matmul(x[:1])), rows
        sums = head.screen_logits(x[:rows])
        assert torch.equal(sums, fused.amx_linear(x[:rows], packed, True)), rows
    # a weight that is not blocks, or not 32 outputs wide, keeps the bf16 packing
    assert Bf16Weight(torch.randn(64, 576)).bp.dtype == torch.bfloat16
    narrow = Bf16Weight(weight(out=48, inp=576))
    assert narrow.bp is None or narrow.bp.dtype != torch.uint8


@amx_tiles
def test_amx_blocks_are_refused_where_their_bits_differ(monkeypatch):
    """amx_blocks checks amx_q4_linear against amx_linear before a weight takes it: blocks
    rebuilt into other weights (here: one block's scale doubled) are refused."""
    import pdserve.engine.layers.quant as quant

    fused = cpu_fused()
    w = weight(out=32, inp=64, seed=14)
    packed = fused.amx_pack(w)
    assert quant.amx_blocks(w, packed) is not None
    real = fused.q4_blocks

    def off(weight):
        blocks = real(weight)
        scale = blocks[0, :2].view(torch.float16)
        blocks[0, :2] = (scale * 2).view(torch.uint8)  # output 0's first block, scaled twice
        return blocks

    monkeypatch.setattr(quant, "cpu_fused", lambda: _Fused(fused, off))
    assert quant.amx_blocks(w, packed) is None


class _Fused:
    """cpu_fused() with q4_blocks replaced (a compiled module's functions cannot be patched)."""

    def __init__(self, real, q4_blocks):
        self._real, self.q4_blocks = real, q4_blocks

    def __getattr__(self, name):
        return getattr(self._real, name)


@needs_onednn_bf16
@pytest.mark.parametrize("amx", [False, pytest.param(True, marks=amx_tiles)])
def test_the_decode_stack_takes_the_blocks_and_gives_the_layer_by_layer_bits(
    q4_model, monkeypatch, amx
):
    """The bf16 mode's decode stack on a model of 4-bit blocks: as Q4Blocks for steps of few rows
    (every CPU; AMX's blocks held off), and on AMX's tiles from the blocks at every step."""
    import pdserve.engine.layers.quant as quant

    if not amx:
        monkeypatch.setattr(quant, "amx_blocks", lambda weight, packed: None)
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
        assert decoder and all(isinstance(q, Bf16Weight) for q in decoder)
        if amx:
            assert all(q.q4 is None and q.bp.dtype == torch.uint8 for q in decoder)
        else:
            assert all(q.q4 is not None for q in decoder)
        assert model.model._stack is not None
        prompts = random_prompts([5, 17, 40], seed=6)
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=True)

        def run():
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

        fused = run()
        assert fused == without_stack(model, run)
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


def test_the_float32_mode_takes_the_blocks_and_keeps_its_bits(q4_model):
    """dtype="float32" on a model whose linears are 4-bit blocks: every decoder linear keeps
    them, the decode stack takes them, and a sequence decodes the same tokens and logprobs alone
    (one-row steps on the blocks) as in a batch larger than the steps the blocks take (oneDNN's
    float32 weight; without AVX-512 the blocks take every step) and as the layers one by one."""
    llm = LLM(
        q4_model,
        dtype="float32",
        kv_cache_memory=1 << 22,
        enable_prefix_caching=False,
        speculative_config=None,
    )
    model = llm.engine.runner.model
    try:
        decoder = [
            m
            for name, m in model.named_modules()
            if isinstance(m, LinearBase) and ".layers." in name
        ]
        assert decoder and all(
            isinstance(m._blocks, Q4Blocks) and m._blocks.dtype == torch.float32 for m in decoder
        )
        assert isinstance(model.lm_head._blocks, Q8Blocks)  # the head: the Q8_0 embedding
        assert model.model._stack is not None
        rows = min(float32_block_rows(), 16) + 4
        prompts = random_prompts([3 + 2 * (i % 12) for i in range(rows)], seed=11)
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=True)

        def outputs(batch):
            outs = llm.generate(batch, params, use_tqdm=False)
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

        batch = outputs(prompts)
        alone = [outputs([p])[0] for p in prompts[:4]]
        assert alone == batch[:4]
        assert without_stack(model, lambda: [outputs([p])[0] for p in prompts[:4]]) == alone
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


def bf16_llm(model: str, **kw) -> LLM:
    """The bf16 mode on `model`, no speculation (each step's rows are the sequences')."""
    return LLM(
        model,
        dtype="float32",
        quantization="bf16",
        kv_cache_memory=1 << 22,
        speculative_config=None,
        **kw,
    )


@needs_onednn_bf16
def test_a_sequence_alone_decodes_the_bits_it_decodes_in_a_batch(q4_model):
    """One sequence's decode steps take the 4-bit blocks (one row), twelve sequences' take
    oneDNN's bf16 weight (twelve rows): the same tokens and logprobs, so greedy output depends
    neither on the batch nor on speculation's extra rows, and a conversation's next turn that
    reuses a decode step's KV sees a prefill's bits."""
    llm = bf16_llm(q4_model, enable_prefix_caching=False)
    try:
        prompts = random_prompts([3 + 2 * i for i in range(12)], seed=7)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True)

        def outputs(outs):
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

        batch = outputs(llm.generate(prompts, params, use_tqdm=False))
        alone = [outputs(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
        assert alone == batch
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


@needs_onednn_bf16
def test_a_next_turn_reusing_decode_written_kv_gives_the_recomputed_bits(q4_model):
    """A conversation's second turn whose cached prefix includes the first turn's answer (its KV
    written by one-row decode steps on the 4-bit blocks) gives the tokens and logprobs of the
    same turn prefilled from scratch (oneDNN's bf16 weight)."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=True)
    first, new = random_prompts([40, 9], seed=8)

    def second_turn(reuse: bool):
        llm = bf16_llm(q4_model, enable_prefix_caching=reuse)
        try:
            answer = llm.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids
            out = llm.generate([first + list(answer) + new], params, use_tqdm=False)[0]
            return out.num_cached_tokens, out.outputs[0].token_ids, out.outputs[0].logprobs
        finally:
            llm.shutdown()

    cached, tokens, logprobs = second_turn(reuse=True)
    assert cached >= 48  # the prompt and the answer's full blocks
    assert second_turn(reuse=False) == (0, tokens, logprobs)
