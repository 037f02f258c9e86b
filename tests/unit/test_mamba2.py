"""Mamba2 (engine/layers/mamba2.py) beside attention: Granite 4.0-H, Bamba, Nemotron-H and
Falcon-H1 (engine/models/mamba_hybrid.py), and the first Mamba's scan (engine/models/mamba.py).
Whole models are checked token for token against transformers in
tests/unit/test_architectures.py (ARCH_KINDS granite-4.0-h, bamba, nemotron-h, falcon-h1,
mamba2, mamba, falcon-mamba, jamba); here the layer's two forms against each other, the compiled
steps against torch's, the variants the kinds leave out (Granite 4.0-H Micro's dense MLP, Granite
4.0's attention-only models with RoPE, Falcon-H1's other norm placements), and the refusals."""

from __future__ import annotations

import pytest
import torch

from helpers.arch import build_arch_model
from helpers.engine import greedy
from helpers.prompt_logprobs import check as check_prompt_logprobs
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kernels import cpu_fused
from pdserve.engine.layers import mamba2

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(length: int, heads=4, head_dim=8, state=16, groups=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(length, heads, head_dim, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(length, heads, generator=g))
    a = -torch.rand(heads, generator=g) * 4 - 0.1
    b = torch.randn(length, groups, state, generator=g)
    c = torch.randn(length, groups, state, generator=g)
    d = torch.randn(heads, generator=g)
    return x, dt, a, b, c, d


@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 200])
def test_dual_form_equals_the_recurrence(length):
    """The chunked form over a prompt leaves the state, and gives the outputs, that one token at
    a time does, from a state a previous chunk left."""
    x, dt, a, b, c, d = _inputs(length)
    start = torch.randn(3, 4, 8, 16)
    chunked, stepped = start.clone(), start.clone()
    got = mamba2._ssm_chunked(x, dt, a, b, c, d, chunked, 1)
    slots = torch.tensor([1])
    want = torch.cat(
        [
            mamba2._ssm_step_torch(
                x[t : t + 1], dt[t : t + 1], a, b[t : t + 1], c[t : t + 1], d, stepped, slots
            )
            for t in range(length)
        ]
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunked, stepped, rtol=1e-4, atol=1e-4)
    assert torch.equal(chunked[0], start[0]) and torch.equal(chunked[2], start[2])


def test_compiled_step_equals_torch():
    """fused_cpu.cpp mamba2_step_ updates scattered slots in place as the torch path does."""
    fused = cpu_fused()
    if fused is None:
        pytest.skip("the compiled CPU kernels are not built here")
    x, dt, a, b, c, d = _inputs(3, heads=6, groups=3)
    slots = torch.tensor([4, 0, 2])
    plain = torch.randn(5, 6, 8, 16)
    compiled = plain.clone()
    want = mamba2._ssm_step_torch(x, dt, a, b, c, d, plain, slots)
    got = mamba2._ssm_step(x, dt, a, b, c, d, compiled, slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled, plain, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="slot 5 out of range"):
        mamba2._ssm_step(x, dt, a, b, c, d, compiled, torch.tensor([5, 0, 2]))


@pytest.mark.parametrize(
    "overrides",
    [
        # Granite 4.0-H Micro: no experts, the shared MLP alone
        {"num_local_experts": 0},
        # Granite 4.0 Micro: attention everywhere, with RoPE (not a hybrid)
        {"layer_types": ["attention"] * 4, "position_embedding_type": "rope"},
    ],
    ids=["h-micro", "attention-only"],
)
def test_granite_4_variants_match_hf(tmp_path, overrides):
    hf = build_arch_model(tmp_path, "granite-4.0-h", initializer_range=0.1, **overrides)
    prompts = [list(range(5, 45)), [7, 9, 11]]
    want = [
        hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    llm = LLM(str(tmp_path), kv_cache_memory=16 << 20, block_size=4, max_num_batched_tokens=16)
    try:
        outs = llm.generate(prompts, greedy(10), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    finally:
        llm.shutdown()


def test_groups_that_do_not_split_are_refused(monkeypatch):
    """Three B/C groups cannot be divided between two ranks: the start says what would work."""
    monkeypatch.setattr(mamba2, "tp_size", lambda: 2)
    monkeypatch.setattr(mamba2, "tp_rank", lambda: 1)
    assert mamba2.rank_groups(4, 8) == (2, 2)
    assert mamba2.rank_groups(1, 8) == (0, 1)
    with pytest.raises(ValueError, match="tensor-parallel size that divides 3"):
        mamba2.rank_groups(3, 6)


def test_nemotron_latent_moe_refused(tmp_path):
    build_arch_model(tmp_path, "nemotron-h", moe_latent_size=32)
    with pytest.raises(ValueError, match="moe_latent_size"):
        LLM(str(tmp_path), kv_cache_memory=16 << 20)


@pytest.mark.parametrize(
    "overrides",
    [{"mamba_rms_norm": False}, {"mamba_norm_before_gate": False}],
    ids=["no-norm", "norm-after-gate"],
)
def test_falcon_h1_norm_variants_match_hf(tmp_path, overrides):
    """Falcon-H1's Mamba2 output without the gated norm (the config's default) and with it
    after the gate (tests/helpers/arch.py falcon-h1 has it before): HF's prompt logprobs."""
    hf = build_arch_model(tmp_path, "falcon-h1", initializer_range=0.1, **overrides)
    prompt = list(range(5, 45))
    llm = LLM(str(tmp_path), kv_cache_memory=16 << 20, block_size=4, max_num_batched_tokens=16)
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=1)
        check_prompt_logprobs(llm.generate([prompt], params, use_tqdm=False)[0], hf, prompt, 1)
    finally:
        llm.shutdown()


def test_mamba1_compiled_scan_equals_torch():
    """fused_cpu.cpp mamba1_scan_ runs a step's rows in order against scattered slots (a
    prompt chunk's rows sharing one, decode rows their own) as the torch loop does."""
    from pdserve.engine.layers import mamba1

    if cpu_fused() is None:
        pytest.skip("the compiled CPU kernels are not built here")
    g = torch.Generator().manual_seed(3)
    rows, inner, state = 7, 40, 8
    x, dt = torch.randn(rows, inner, generator=g), torch.rand(rows, inner, generator=g)
    a = -torch.rand(inner, state, generator=g) * 3
    b, c = torch.randn(rows, state, generator=g), torch.randn(rows, state, generator=g)
    d = torch.randn(inner, generator=g)
    slots = torch.tensor([3, 0, 2, 2, 2, 2, 2])  # two decode rows, then a chunk of five
    plain = torch.randn(4, inner, state, generator=g)
    compiled = plain.clone()
    want = mamba1._scan_torch(x, dt, a, b, c, d, plain, slots)
    got = mamba1._scan(x, dt, a, b, c, d, compiled, slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled, plain, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="slot 4 out of range"):
        mamba1._scan(x, dt, a, b, c, d, compiled, slots.clone().fill_(4))
