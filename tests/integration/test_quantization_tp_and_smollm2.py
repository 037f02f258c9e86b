"""Serving precisions where they need rank processes or the real model: TP=2 int8 (each rank
quantizes its own shard) stays close to TP=1 int8, and quantization="auto" picks a mode within its
bound for the embedded SmolLM2. The linears, the modes and auto on tiny models:
tests/unit/test_quantization.py."""

from __future__ import annotations

import pytest

from helpers.engine import needs_x86_int8
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.quality import QUALITY_BOUNDS, probe_ids

pytestmark = pytest.mark.usefixtures("one_thread")


@needs_x86_int8
def test_engine_tp2_int8_matches_tp1(refs):
    """Each rank quantizes its own shard: greedy tokens of TP=2 int8 equal TP=1 int8 on most
    prompts, and logprobs stay close on all."""
    model_dir, _, prompts, _ = refs("llama-gqa")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    one = LLM(model_dir, quantization="int8", kv_cache_memory=1 << 22)
    try:
        want = [one.generate([p], params, use_tqdm=False)[0].prompt_logprobs for p in prompts[3:5]]
    finally:
        one.shutdown()
    two = LLM(model_dir, quantization="int8", tensor_parallel_size=2, kv_cache_memory=1 << 22)
    try:
        for p, a in zip(prompts[3:5], want):
            b = two.generate([p], params, use_tqdm=False)[0].prompt_logprobs
            assert max(abs(a[i][p[i]] - b[i][p[i]]) for i in range(1, len(p))) < 0.05
    finally:
        two.shutdown()


def test_smollm2_auto_picks_a_mode_within_its_bound():
    """The embedded model: auto scores the probe in float32 and in each candidate and serves the
    first within bound; the note says which and by how much."""
    from helpers.models import require_smollm2

    require_smollm2()
    llm = LLM("smollm2", max_model_len=1024, kv_cache_memory=1 << 26)
    try:
        chosen, note = llm.engine.config.quantization, llm.engine.mode_note
        assert chosen in (None, "int8", "int4", "bf16"), note
        if chosen is not None:
            assert f"auto chose {chosen}" in note and f"bound +{QUALITY_BOUNDS[chosen]:.0%}" in note
        # the chosen mode still answers sensibly
        out = (
            llm.generate(
                ["The capital of France is"],
                SamplingParams(temperature=0, max_tokens=4),
                use_tqdm=False,
            )[0]
            .outputs[0]
            .text
        )
        assert "Paris" in out, (out, note)
        ids = probe_ids(llm.engine.tokenizer, 128)
        assert len(ids) == 128 and ids[0] == llm.engine.tokenizer.bos_token_id
    finally:
        llm.shutdown()
