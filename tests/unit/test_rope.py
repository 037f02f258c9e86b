"""Our rotary embedding against transformers' own LlamaRotaryEmbedding, per rope type."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from helpers.models import TINY_CONFIG
from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.rotary import RotaryEmbedding, rope_inv_freq

POSITIONS = [0, 7, 300]
MAX_POS = 512


def scaled(rope_type: str, theta: float, factor: float, original_max: int, **extra) -> dict:
    """A scaled rope's parameters: `factor` times the `original_max` positions it trained on."""
    return dict(
        rope_type=rope_type,
        rope_theta=theta,
        factor=factor,
        original_max_position_embeddings=original_max,
        **extra,
    )


ROPE_CASES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "default-theta": dict(rope_type="default", rope_theta=500000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "llama3": scaled("llama3", 500000.0, 8.0, 64, low_freq_factor=1.0, high_freq_factor=4.0),
    "yarn": scaled("yarn", 10000.0, 4.0, 128),
    "yarn-betas": scaled("yarn", 1000000.0, 8.0, 64, beta_fast=16.0, beta_slow=2.0),
}


def hf_config(rope: dict, head_dim: int | None = None) -> LlamaConfig:
    extra = {} if head_dim is None else {"head_dim": head_dim}
    shape = {**TINY_CONFIG, "num_hidden_layers": 1, "max_position_embeddings": MAX_POS}
    return LlamaConfig(
        **shape, num_attention_heads=4, num_key_value_heads=2, rope_parameters=dict(rope), **extra
    )


@pytest.mark.parametrize("head_dim", [None, 32])
@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_matches_hf_rotary_embedding(case, head_dim):
    rope = ROPE_CASES[case]
    cfg = hf_config(rope, head_dim)
    mc = ModelConfig.from_hf(cfg)
    assert mc.rope_type == rope["rope_type"]
    assert mc.rope_theta == rope["rope_theta"]
    assert mc.head_dim == (head_dim or 16)

    inv_freq, attn_factor = rope_inv_freq(cfg, mc.rope_type, mc.rope_theta, mc.head_dim)
    hf = LlamaRotaryEmbedding(cfg)
    assert inv_freq.shape == (mc.head_dim // 2,)
    torch.testing.assert_close(inv_freq, hf.inv_freq.float(), rtol=1e-6, atol=0)
    assert attn_factor == pytest.approx(float(hf.attention_scaling), rel=1e-6)
    if rope["rope_type"] == "yarn":
        assert attn_factor != 1.0  # yarn scales cos/sin: a dropped factor must show

    ours = RotaryEmbedding(inv_freq, attn_factor, MAX_POS)
    pos = torch.tensor(POSITIONS)
    x = torch.zeros(1, len(POSITIONS), mc.head_dim)
    hf_cos, hf_sin = hf(x, pos[None, :])
    torch.testing.assert_close(ours.cos[pos], hf_cos[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.sin[pos], hf_sin[0], rtol=1e-5, atol=1e-6)

    # and the rotation itself, in our [T, heads, head_dim] layout vs HF's [B, heads, T, head_dim]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(POSITIONS), 4, mc.head_dim, generator=g)
    k = torch.randn(len(POSITIONS), 2, mc.head_dim, generator=g)
    q_ours, k_ours = ours(pos, q.clone(), k.clone())  # (the compiled path rotates in place)
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin
    )
    torch.testing.assert_close(q_ours, q_hf[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_ours, k_hf[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_scaled_types_differ_from_default():
    """Guards the comparison above against a config whose scaling silently became a no-op."""
    base, _ = rope_inv_freq(hf_config(ROPE_CASES["default"]), "default", 10000.0, 16)
    for case in ("linear", "yarn"):
        cfg = hf_config(ROPE_CASES[case])
        inv, _ = rope_inv_freq(cfg, case, 10000.0, 16)
        assert not torch.allclose(inv, base), case


@pytest.mark.parametrize(
    "rope_type, params",
    [
        ("dynamic", dict(factor=2.0)),
        (
            "longrope",
            dict(
                short_factor=[1.0] * 8, long_factor=[2.0] * 8, original_max_position_embeddings=128
            ),
        ),
    ],
)
def test_unsupported_rope_types_are_refused(rope_type, params):
    cfg = hf_config(dict(rope_type=rope_type, rope_theta=10000.0, **params))
    with pytest.raises(ValueError) as exc:
        rope_inv_freq(cfg, rope_type, 10000.0, 16)
    assert "rope_type" in str(exc.value) and rope_type in str(exc.value)


def test_unsupported_rope_type_refused_by_llm(tiny_models, tmp_path):
    """The refusal reaches the user as a ValueError from LLM(...), not a failure mid-forward."""
    from pdserve.engine import LLM

    src, _ = tiny_models("llama-gqa")
    dst = pathlib.Path(shutil.copytree(src, tmp_path / "dynamic"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_type"):
        LLM(str(dst), kv_cache_memory=1 << 22)
