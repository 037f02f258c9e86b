"""engine.loader on the real model: the embedded SmolLM2 GGUF's conversion in the cache the
suite shares (the first test of a run on a clean cache converts it, whichever test that is), which
a second resolve reuses untouched, and HF's own model loaded from the result answers. The
conversion itself, step by step, on tiny GGUFs: tests/unit/test_loader.py. (This test converted
into a cache of its own until the suite's time budget had no room for a second 20 s conversion.)"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.engine.loader import load_hf_config, resolve_model


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("PDSERVE_NO_PROGRESS", "1")


# --- the real model --------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_converts_and_answers():
    t0 = time.perf_counter()
    out = resolve_model("smollm2")
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("SMOLLM2") == out
    cached = time.perf_counter() - t0
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    print(f"\nsmollm2: first resolve {first:.1f}s, cached resolve {cached * 1000:.1f}ms")

    cfg = load_hf_config(out)
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        576,
        9,
        3,
    )
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0 and cfg["dtype"] == "float32"

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tok.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
