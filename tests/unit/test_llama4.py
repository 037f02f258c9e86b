"""Llama 4 beyond the architecture tests (tests/unit/test_architectures.py runs the "llama4" kind
of tests/helpers/arch.py against transformers: chunked attention, the layer without rotary and
its temperature tuning, the weightless q/k norms, experts weighing their inputs, the reordered
rotary pairs). Here: a Llama4ForConditionalGeneration checkpoint, as Meta released Scout and
Maverick (the language model's tensors under `language_model.`, a vision tower beside them), is
served for its text with transformers' greedy tokens, and its images are refused by name; the
config's chunks follow its layer types (CUDA refused until it has run there); the rotary pairs'
reordering keeps every score.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from helpers.arch import build_arch_model
from helpers.models import hf_greedy
from helpers.vlm import random_images
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.layers.rotary import pairs_as_halves

PROMPTS = ([5, 17, 33, 2, 90, 41, 7, 12] * 3, [3, 9, 27])
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def conditional(tmp_path_factory):
    """A tiny Llama4ForConditionalGeneration whose language model is the "llama4" kind's."""
    import transformers

    text_dir = tmp_path_factory.mktemp("llama4-text")
    text = build_arch_model(text_dir, "llama4", initializer_range=0.1)
    vision = transformers.Llama4VisionConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
    )
    config = transformers.Llama4Config(
        vision_config=vision, text_config=text.config.to_dict(), image_token_index=250
    )
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    model.language_model.load_state_dict(text.state_dict())
    path = tmp_path_factory.mktemp("llama4")
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # (the kind's word-level one)
        shutil.copy(text_dir / name, path / name)
    return str(path), model


def test_a_released_layout_checkpoint_serves_its_text(conditional):
    path, model = conditional
    llm = LLM(path, dtype="float32", kv_cache_memory=16 << 20, max_model_len=256)
    try:
        assert llm.engine.model_config.text_only_of == "Llama4ForConditionalGeneration"
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        want = [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        with pytest.raises(ValueError, match="Llama4ForConditionalGeneration's images are not"):
            llm.generate({"prompt": "t5", "multi_modal_data": {"image": random_images(1)}})
    finally:
        llm.shutdown()


def test_the_chunked_layers_are_the_rotary_ones(conditional):
    path, _ = conditional
    from transformers import AutoConfig

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    assert cfg.architecture == "Llama4ForCausalLM"
    assert cfg.layer_chunks == (16, 16, None, 16) and cfg.layer_ropes == (True, True, False, True)
    assert cfg.layer_windows == (None,) * 4 and cfg.tie_word_embeddings is False
    with pytest.raises(ValueError, match=r"chunked attention\) runs on device='cpu' only"):
        EngineConfig(model=path, kv_cache_memory=16 << 20, device="cuda").resolve(cfg)


def test_reordered_rotary_pairs_keep_every_score():
    """Llama 4 turns neighbouring values (2i, 2i + 1) by frequency i; reordered into halves,
    Llama's rotary turns (i, i + d/2) by it: the same rotated query and key values, reordered
    alike, so every score between a query and a key at other positions is the same."""
    d, heads = 8, 2
    g = torch.Generator().manual_seed(0)
    wq, wk = torch.randn(heads * d, 6, generator=g), torch.randn(heads * d, 6, generator=g)
    x = torch.randn(6, generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))

    def pairs(w, pos):  # Llama 4: complex rotation of neighbouring pairs
        angle = pos * inv
        v = torch.view_as_complex((w @ x).view(heads, d // 2, 2))
        return torch.view_as_real(v * torch.polar(torch.ones_like(angle), angle)).reshape(heads, d)

    def halves(w, pos, reorder=True):  # Llama: rotate_half, over the reordered rows
        angle = pos * inv
        v = ((pairs_as_halves(w, d) if reorder else w) @ x).view(heads, d)
        cos, sin = torch.cat([angle.cos()] * 2), torch.cat([angle.sin()] * 2)
        rotated = torch.cat([-v[:, d // 2 :], v[:, : d // 2]], dim=-1)
        return v * cos + rotated * sin

    want = (pairs(wq, 7) * pairs(wk, 2)).sum(-1)
    torch.testing.assert_close((halves(wq, 7) * halves(wk, 2)).sum(-1), want)
    unordered = (halves(wq, 7, False) * halves(wk, 2, False)).sum(-1)
    assert not torch.allclose(unordered, want)  # (the reordering is what makes them equal)
