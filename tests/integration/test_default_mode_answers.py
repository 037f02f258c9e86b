"""The default mode answers the README's first example as float32 does (issue #48, must-show c):
`LLM("smollm2")` (quantization="auto", kv_cache_dtype="auto") against dtype="float32", greedy,
through the chat template as `pdserve chat` sends it."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams

QUESTION = "What is the capital of France?"  # README.md's `pdserve chat` example


def answer(llm) -> tuple[list[int], str]:
    tok = llm.get_tokenizer()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=True, add_generation_prompt=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.outputs[0].text


@pytest.mark.slow
def test_the_default_mode_answers_the_readme_question_as_float32():
    from helpers.models import require_smollm2

    require_smollm2()
    torch.set_num_threads(2)
    kw = dict(max_model_len=1024, kv_cache_memory=1 << 26)
    ref = LLM("smollm2", dtype="float32", **kw)
    try:
        want = answer(ref)
    finally:
        ref.shutdown()
    auto = LLM("smollm2", **kw)
    try:
        got, note = answer(auto), auto.engine.mode_note
    finally:
        auto.shutdown()
    assert "Paris" in want[1], want
    assert got == want, (got, want, note)
