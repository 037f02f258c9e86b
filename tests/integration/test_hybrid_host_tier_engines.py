"""A hybrid model's recurrent states in the host tier (engine/kv_host_tier.py), through the engine:
conversations that outgrow two or three state slots and a KV pool of about a hundred tokens
(tests/helpers/hybrid_turns.py), on Gated DeltaNet (Qwen3.5), Mamba2 beside attention
(Granite 4.0-H) and Mamba alone (Falcon Mamba: no KV at all): HF's greedy tokens and logprobs
with the tier, the same prompts served from the cache where the tierless engine recomputed them,
states and blocks restored. Then under tensor parallelism: rank 0 saves and restores every
rank's part of a slot (the ranks' states files, under kv_cache_shared_dir), as it does their KV
blocks, on Qwen3.5 and on Granite 4.0-H (one B/C group that both ranks hold)."""

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


@pytest.mark.parametrize("kind", ["qwen3.5", "granite-4.0-h", "falcon-mamba"])
def test_conversations_past_their_slots_resume_from_the_tier(refs, kind):
    """One conversation more than the slots (two or three) and a KV pool of about a hundred
    tokens (helpers/hybrid_turns.py): each conversation's first turn, its second, then its first
    again. Every prompt gets HF's greedy tokens and logprobs with the tier; the second turns and
    the repeats start from their cached prefix (states and blocks restored), where the tierless
    engine, whose states gave way, starts over."""
    model_dir, hf, *_ = refs(kind)
    shape, slots, per_slot = few_slots(model_dir)
    off = LLM(model_dir, **shape)
    try:
        assert off.engine.scheduler.slots.num_slots == slots in (2, 3)
        outs_off, firsts = past_the_slots(off, slots)
    finally:
        off.shutdown()
    on = LLM(model_dir, kv_host_tier_bytes=64 * per_slot, **shape)
    try:
        outs_on, _ = past_the_slots(on, slots)
        for prompt, out, held in outs_on:
            check_greedy(out, hf_greedy(hf, prompt, NEW))
            assert held == out.num_cached_tokens  # (what a local prefill's check reads)
        tier = on.engine.block_manager.tier
        later_on = [out.num_cached_tokens for _, out, _ in outs_on[firsts:]]
        later_off = [out.num_cached_tokens for _, out, _ in outs_off[firsts:]]
        assert all(held == 0 for *_, held in outs_off)  # (blocks held, but no state after)
        assert all(n > 0 for n in later_on), later_on
        assert sum(later_on) > sum(later_off), (later_on, later_off)
        assert tier.states_stored > 0 and tier.states_restored > 0 and tier.states_refused == 0
        if on.engine.kv_cache.numel():  # (Falcon Mamba has no KV blocks to restore)
            assert tier.restored > 0
        assert tier.peak_bytes <= tier.capacity_bytes
        assert_no_leaks(on.engine)
    finally:
        on.shutdown()


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
