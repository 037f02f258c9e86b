"""Mixture-of-experts (engine/layers/moe.py, engine/models/moe.py) beyond the shared architecture
harness: the routed computation against a plain per-token loop, and both checkpoint layouts
(per-expert tensors as on the hub and as transformers writes them, and transformers 5's fused
3-D expert tensors) on models whose experts move the logits enough that a wrong routing weight
or shared-expert gate changes the greedy tokens (tests/helpers/arch.py's kinds use HF's default
0.02 weight scale, at which the MLPs move the logits by ~0.01)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from helpers.arch import arch_prompts, build_arch_model
from helpers.engine import KV, greedy
from helpers.models import LazyGreedy
from pdserve.engine import LLM
from pdserve.engine.layers.moe import FusedMoE

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 32
STRONG = 0.1  # initializer_range: logits' std ~0.8 instead of ~0.18


def _per_token_reference(moe: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, straight from the definition."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(moe.gate.weight @ x[t], dim=-1)
        top = sorted(range(moe.num_experts), key=lambda e: -float(probs[e]))[: moe.top_k]
        total = sum(float(probs[e]) for e in top) if moe.renormalize else 1.0
        for e in top:
            ex = moe.experts[e]
            gate, up = (ex.gate_up_proj.weight @ x[t]).chunk(2)
            out[t] += (
                float(probs[e])
                / total
                * (ex.down_proj.weight @ (torch.nn.functional.silu(gate) * up))
            )
        if moe.shared_expert is not None:
            sh = moe.shared_expert
            gate, up = (sh.gate_up_proj.weight @ x[t]).chunk(2)
            y = sh.down_proj.weight @ (torch.nn.functional.silu(gate) * up)
            out[t] += torch.sigmoid(moe.shared_expert_gate.weight @ x[t]) * y
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shared", [0, 48])
def test_routing_matches_per_token_reference(renormalize, shared):
    torch.manual_seed(0)
    moe = FusedMoE(32, 6, 2, 40, renormalize, shared)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(37, 32)
    want = _per_token_reference(moe, x)
    with torch.no_grad():
        got = moe(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # the graph-capturable path (every expert on every token) gives the same sums
        w, ids = torch.softmax(moe.gate(x), -1).topk(2, dim=-1)
        if renormalize:
            w = w / w.sum(-1, keepdim=True)
        torch.testing.assert_close(
            moe._all_experts(x, w, ids), moe._routed_experts(x, w, ids), rtol=1e-4, atol=1e-4
        )
        # packed for oneDNN (prepare_linears' float path): the same
        for m in moe.modules():
            if hasattr(m, "finalize"):
                m.finalize(None, release_dense=False)
        torch.testing.assert_close(moe(x), want, rtol=1e-4, atol=1e-4)
        # a lone token (decode at batch 1) reaches only its own top_k experts
        torch.testing.assert_close(moe(x[5:6]), want[5:6], rtol=1e-4, atol=1e-4)


def _fuse_experts(path, hf_model) -> None:
    """Rewrite the checkpoint as transformers 5 holds it in memory: per layer
    `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]."""
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    (path / "model.safetensors").unlink()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("layout", ["fused"])  # per-expert: test_architectures.py
@pytest.mark.parametrize("kind", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_checkpoint_layouts_match_hf(tmp_path, kind, layout):
    hf = build_arch_model(tmp_path, kind, initializer_range=STRONG)
    if layout == "fused":
        _fuse_experts(tmp_path, hf)
    else:  # what transformers writes: one tensor per expert and projection
        from safetensors import safe_open

        with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
            names = list(f.keys())
        assert any(".experts.0." in n for n in names), names
    prompts = [p for i, p in enumerate(arch_prompts()) if i in (1, 3, 6)]
    want = LazyGreedy(hf, prompts, NEW)
    llm = LLM(str(tmp_path), kv_cache_memory=KV, block_size=16, max_num_batched_tokens=64)
    try:
        outs = llm.generate(prompts, greedy(NEW), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    finally:
        llm.shutdown()
