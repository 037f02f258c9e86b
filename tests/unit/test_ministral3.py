"""Mistral 3's released checkpoints (Mistral Small 3.1/3.2, Ministral 3) are
Mistral3ForConditionalGeneration: a Pixtral vision tower beside a Mistral or Ministral 3 language
model. The engine serves their text (tests/unit/test_architectures.py runs the "ministral3" kind
of tests/helpers/arch.py, Llama 4's query temperature included, against transformers); here a
tiny conditional checkpoint over that kind gives transformers' tokens, and its images are
refused by name, since its processor needs torchvision.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from helpers.arch import build_arch_model
from helpers.models import hf_greedy
from helpers.vlm import random_images
from pdserve.engine import LLM, SamplingParams

PROMPTS = ([5, 17, 33, 2, 90, 41, 7, 12] * 5, [3, 9, 27])  # (40 tokens: past 16, a step up)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("text_kind", ["ministral3", "mistral-sw"])
def test_a_mistral3_checkpoint_serves_its_text(tmp_path, text_kind):
    import transformers

    text_dir = tmp_path / "text"
    text = build_arch_model(text_dir, text_kind, initializer_range=0.1)
    vision = transformers.PixtralVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=64,
        patch_size=8,
        head_dim=16,
    )
    config = transformers.Mistral3Config(
        vision_config=vision, text_config=text.config.to_dict(), image_token_index=250
    )
    torch.manual_seed(0)
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    path = tmp_path / "mistral3"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # (the kind's word-level one)
        shutil.copy(text_dir / name, path / name)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=16 << 20, max_model_len=256)
    try:
        assert llm.engine.model_config.text_only_of == "Mistral3ForConditionalGeneration"
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        want = [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        with pytest.raises(ValueError, match="Mistral3ForConditionalGeneration's images are not"):
            llm.generate({"prompt": "t5", "multi_modal_data": {"image": random_images(1)}})
    finally:
        llm.shutdown()
