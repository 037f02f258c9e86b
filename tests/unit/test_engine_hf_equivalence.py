"""The engine on tiny random models against HF transformers' own greedy decoding: every model kind
in sequential/batched, chunked and prefix-cached modes, repeated prompts served from the prefix
cache, and preemption under memory pressure."""

from __future__ import annotations

import pytest

from helpers.engine import KV, greedy
from helpers.models import NEW, SHARED_PREFIX
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ["llama-gqa", "llama-mqa-tied", "llama3-rope", "qwen2-bias", "qwen2-yarn"]


def decoded(tok, prompt, output) -> str:
    """The output's text as the model's tokenizer decodes it after the prompt's last tokens
    (the qwen2 kinds get a byte-level decoder from AutoTokenizer, which joins words without spaces)."""
    ctx = prompt[-6:]
    before = tok.decode(ctx, skip_special_tokens=True)
    after = tok.decode(ctx + output, skip_special_tokens=True)
    assert after.startswith(before)
    return after[len(before) :]


# name: (block_size, enable_prefix_caching, max_num_batched_tokens, submit one at a time?)
_MODES = {
    "sequential-prefix-bs16": (16, True, 64, True),
    "batched-prefix-bs16": (16, True, 2048, False),
    "batched-noprefix-bs4": (4, False, 2048, False),
    "chunk32-sequential-prefix-bs4": (4, True, 32, True),
    "chunk32-batched-noprefix-bs16": (16, False, 32, False),
}
# name: (LLM kwargs, submit one at a time?)
MODES = {
    name: (
        dict(block_size=bs, enable_prefix_caching=prefix, max_num_batched_tokens=budget),
        sequential,
    )
    for name, (bs, prefix, budget, sequential) in _MODES.items()
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_hf(refs, kind, mode):
    model_dir, _, prompts, expected = refs(kind)
    kwargs, sequential = MODES[mode]
    # the sequential modes count steps (one token a step, a prompt in budget-sized chunks): no
    # speculative decoding and the plain chunking there (the long-prefill policy sizes chunks
    # by time: tests/unit/test_long_prefill.py)
    spec = None if sequential else "auto"
    plain = dict(prefill_step_target_s=0) if sequential else {}
    llm = LLM(model_dir, kv_cache_memory=KV, speculative_config=spec, **kwargs, **plain)
    engine = llm.engine
    budget = kwargs["max_num_batched_tokens"]
    if sequential:
        outs = []
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, greedy())
            steps, first_token_step, final = 0, None, None
            while engine.has_unfinished_requests():
                steps += 1
                for out in engine.step():
                    if first_token_step is None and out.outputs[0].token_ids:
                        first_token_step = steps
                    if out.finished:
                        final = out
            outs.append(final)
            # prefill ran in ceil(uncached / budget) steps, then one token per step
            uncached = len(prompt) - final.num_cached_tokens
            assert first_token_step == -(-uncached // budget), (
                len(prompt),
                final.num_cached_tokens,
            )
            assert steps == first_token_step + NEW - 1
            if len(prompt) == 200 and budget == 32:
                assert first_token_step == 7
    else:
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for prompt, out, want in zip(prompts, outs, expected):
        comp = out.outputs[0]
        assert comp.token_ids == want, f"prompt of {len(prompt)} tokens"
        assert comp.finish_reason == "length"
        assert comp.text == decoded(llm.get_tokenizer(), prompt, want)
    cached = [o.num_cached_tokens for o in outs]
    if kwargs["enable_prefix_caching"] and sequential:
        # the 2nd and 3rd shared-prefix prompts reuse the first one's full prefix blocks
        assert cached[-2] == cached[-1] == SHARED_PREFIX
    if not kwargs["enable_prefix_caching"]:
        assert not any(cached)
    assert_no_leaks(engine)


def test_repeated_prompt_hits_cache_and_matches(refs):
    """The same prompts a second time: served mostly from the cache, same tokens."""
    model_dir, _, prompts, expected = refs("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=16, max_num_batched_tokens=64)
    first = llm.generate(prompts, greedy(), use_tqdm=False)
    again = llm.generate(prompts, greedy(), use_tqdm=False)
    for prompt, a, b, want in zip(prompts, first, again, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == want
        # everything but the last token (which must be recomputed to sample) in full blocks
        assert b.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert_no_leaks(llm.engine)


def test_preemption_under_memory_pressure_matches_hf(refs):
    """A KV cache too small for the whole batch: sequences are preempted, recomputed, still exact."""
    model_dir, _, prompts, expected = refs("llama-gqa")
    llm = LLM(model_dir, kv_cache_memory=KV, max_model_len=256)
    per_block = llm.engine.kv_cache[:, :, 0].numel() * llm.engine.kv_cache.element_size()
    llm = LLM(
        model_dir, kv_cache_memory=20 * per_block, max_model_len=256, max_num_batched_tokens=64
    )
    assert llm.engine.block_manager.num_blocks == 20
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm.engine)
