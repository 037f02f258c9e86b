"""The default mode answers every example in the README as float32 does (issue #48, must-show c):
`LLM("smollm2")` (quantization="auto", kv_cache_dtype="auto") against dtype="float32", greedy:
the `pdserve chat` question and the OpenAI client's chat turn through the chat template, as the
router sends them, and the `pdserve generate` completion as plain text. The client example samples
(top_k 20); greedy is the part of it that can be compared token for token."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams

QUESTION = "What is the capital of France?"  # README.md's `pdserve chat` example
# README.md: `pdserve chat`, the OpenAI client's chat turn, `pdserve generate`
CHATS = (QUESTION, "Write a haiku about GPUs.")
COMPLETIONS = ("def fibonacci(n):",)
NEW_TOKENS = 32


def answers(llm) -> list[tuple[list[int], str]]:
    tok = llm.get_tokenizer()
    prompts = []
    for q in CHATS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True
        )
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    prompts += list(COMPLETIONS)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]


@pytest.mark.slow
def test_the_default_mode_answers_the_readme_examples_as_float32():
    from helpers.models import require_smollm2

    require_smollm2()
    kw = dict(max_model_len=1024, kv_cache_memory=1 << 26)
    ref = LLM("smollm2", dtype="float32", **kw)
    try:
        want = answers(ref)
    finally:
        ref.shutdown()
    auto = LLM("smollm2", **kw)
    try:
        got, note = answers(auto), auto.engine.mode_note
    finally:
        auto.shutdown()
    assert "Paris" in want[0][1], want
    for example, g, w in zip(CHATS + COMPLETIONS, got, want):
        assert g == w, (example, g[1], w[1], note)
