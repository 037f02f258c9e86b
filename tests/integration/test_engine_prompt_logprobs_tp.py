"""SamplingParams(prompt_logprobs=k) across TP ranks (spawned processes): the same logprobs as HF's
log-softmax of the same positions, as on one rank (tests/unit/test_engine_prompt_logprobs.py)."""

from __future__ import annotations

import pytest

from helpers.engine import KV
from helpers.prompt_logprobs import check
from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tp2_gives_the_same_prompt_logprobs(refs):
    model_dir, hf, prompts, _ = refs("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV, tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        out = llm.generate(
            prompts[4], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False
        )[0]
        check(out, hf, prompts[4], 2)
    finally:
        llm.shutdown()
