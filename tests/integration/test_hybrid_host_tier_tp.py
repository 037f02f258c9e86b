"""A hybrid model's recurrent states in the host tier under tensor parallelism: rank 0 saves and
restores every rank's part of a slot (the ranks' states files, under kv_cache_shared_dir), as it
does their KV blocks. The conversations of tests/unit/test_hybrid_host_tier.py on two ranks,
Gated DeltaNet (Qwen3.5) and Mamba2 with one B/C group that both ranks hold (Granite 4.0-H):
HF's greedy tokens and logprobs, every later turn from its cached prefix, states restored."""

from __future__ import annotations

import pytest

from helpers.arch import arch_refs
from helpers.hybrid_turns import NEW, check_greedy, few_slots, hf_greedy, past_the_slots
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    cache: dict = {}
    return lambda kind: arch_refs(tmp_path_factory, cache, kind)


@pytest.mark.parametrize("kind", ["qwen3.5", "granite-4.0-h"])
def test_tp2_conversations_past_their_slots_resume_from_the_tier(refs, kind, tmp_path):
    model_dir, hf, *_ = refs(kind)
    shape, slots, per_slot = few_slots(
        model_dir, tensor_parallel_size=2, kv_cache_shared_dir=str(tmp_path)
    )
    llm = LLM(model_dir, kv_host_tier_bytes=128 * per_slot, **shape)
    try:
        assert llm.engine.scheduler.slots.num_slots == slots
        outs, firsts = past_the_slots(llm, slots)
        for prompt, out, held in outs:
            check_greedy(out, hf_greedy(hf, prompt, NEW))
            assert held == out.num_cached_tokens
        later = [out.num_cached_tokens for _, out, _ in outs[firsts:]]
        assert all(n > 0 for n in later), later
        tier = llm.engine.block_manager.tier
        assert tier.states_restored > 0 and tier.restored > 0 and tier.states_refused == 0
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
