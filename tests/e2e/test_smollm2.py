"""The embedded SmolLM2-135M-Instruct against HF transformers on the same float32 weights, with
dtype="float32" (the reference mode; dtype "auto" may quantize: tests/unit/test_quantization.py).

Greedy outputs must be token-identical, whatever the batching (checked teacher-forced: HF's argmax
after the prompt and each prefix of the engine's tokens, one HF pass a prompt, equals the engine's
tokens exactly when they are HF's greedy ones): one request at a time (seven of them), and all
together with a token budget that splits the long prompt into many chunks, then again with real
prefix cache hits (prefix caching off is the tiny models' tests', tests/unit/test_engine_*.py).
Also tp=3 (the degree that divides SmolLM2's 9 heads and 3 KV heads).
"""

from __future__ import annotations

import inspect
import json.decoder

import pytest
import torch

from helpers.models import hf_teacher_forced
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 16

TEXT_PROMPTS = [
    "The capital of France is",
    "La tour Eiffel a été construite en",
    "Die wichtigsten Flüsse Deutschlands sind",
    "El desayuno típico en España incluye",
    "Москва — столица",
    "人工智能的发展历史可以追溯到",
    "日本の首都は東京で、",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "function debounce(fn, ms) {\n  let timer;\n",
    "SELECT name, COUNT(*) FROM orders JOIN customers ON",
    "Q: What is 17 * 23?\nA:",
    '{"name": "pdserve", "version": "0.1", "features": [',
    "Roses are red,\nViolets are blue,\n",
    "1, 1, 2, 3, 5, 8, 13, 21,",
]


@pytest.fixture(scope="module")
def smollm2_prompts():
    from pdserve.engine.loader import resolve_model
    from pdserve.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model("smollm2"))
    prompts = [tok.encode(p) for p in TEXT_PROMPTS]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Name three primary colors."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompts.append(tok.encode(chat, add_special_tokens=False))
    # a long, real document: the source of a stdlib module, cut to just over 1,600 tokens
    source = tok.encode(inspect.getsource(json.decoder))
    assert len(source) > 1600
    prompts.append(source[:1600])
    assert len(prompts) == 16
    return prompts


@pytest.fixture(scope="module")
def reference():
    """(prompt, tokens) -> HF's teacher-forced argmax (hf_teacher_forced), each pair computed once
    for the module: every test's output of a prompt should be the same tokens."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine.loader import resolve_model

    model = AutoModelForCausalLM.from_pretrained(
        str(resolve_model("smollm2")), dtype=torch.float32
    ).eval()
    seen: dict[tuple, list[int]] = {}

    def argmax(prompt: list[int], tokens: list[int]) -> list[int]:
        key = (tuple(prompt), tuple(tokens))
        if key not in seen:
            seen[key] = hf_teacher_forced(model, prompt, tokens)
        return seen[key]

    return argmax


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# the prompts run one at a time: English, Russian, Chinese, Japanese, code, the chat, the long
# document (the suite's time budget: each costs a prefill and 16 unbatched steps)
ONE_AT_A_TIME = (0, 4, 5, 6, 7, 14, 15)


def _check(outputs, reference, prompts):
    assert len(outputs) == len(prompts)
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        tokens = list(out.outputs[0].token_ids)
        assert len(tokens) == NEW_TOKENS, f"prompt {i}: {len(tokens)} tokens"
        hf = reference(prompt, tokens)
        diverged = next((j for j, (a, b) in enumerate(zip(tokens, hf)) if a != b), None)
        assert diverged is None, (
            f"prompt {i} ({len(prompt)} tokens) diverged at token {diverged}: the engine's "
            f"{tokens[diverged]}, HF's greedy {hf[diverged]}"
        )


# (all together at the default budget is the chunked case's batch without its chunks)
@pytest.mark.parametrize("mode", ["one_at_a_time", "chunked"])
def test_greedy_matches_hf(mode, smollm2_prompts, reference):
    kwargs = dict(dtype="float32", kv_cache_memory=256 << 20, max_model_len=2048)
    if mode == "chunked":  # the 1,600-token prompt runs as 13 chunks next to the other requests
        kwargs["max_num_batched_tokens"] = 128
    llm = LLM("smollm2", **kwargs)
    prompts = smollm2_prompts
    if mode == "one_at_a_time":  # a sample of them (all 16 run in the batch of the other mode)
        prompts = [smollm2_prompts[i] for i in ONE_AT_A_TIME]
        outputs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _check(outputs, reference, prompts)
    if mode == "chunked":
        # again on the warm engine: now every prompt's full blocks come from the prefix cache
        again = llm.generate(smollm2_prompts, GREEDY, use_tqdm=False)
        _check(again, reference, smollm2_prompts)
        assert again[-1].num_cached_tokens >= 1584, "the long prompt should hit the prefix cache"
    assert_no_leaks(llm.engine)


def test_tp3_matches_tp1(smollm2_prompts, reference):
    picks = [0, 5, 7, 15]  # English, Chinese, code, the long document
    prompts = [smollm2_prompts[i] for i in picks]
    llm = LLM(
        "smollm2",
        dtype="float32",
        tensor_parallel_size=3,
        kv_cache_memory=128 << 20,
        max_model_len=2048,
    )
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        _check(outputs, reference, prompts)
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
