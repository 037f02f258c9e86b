"""The engine with a host-memory tier below its KV cache (engine/kv_host_tier.py) under eviction
pressure: a small KV pool, several long conversations cycling so that each one's blocks are
evicted before it comes back. Greedy tokens are the same with the tier on and off; with it on the
later turns restore their prefix from the tier (restores > 0, host hits), the tier stays within
its cap, and everything is free when idle."""

from __future__ import annotations

import pytest

from helpers.engine import KV, greedy, tier_settings
from helpers.models import random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM

pytestmark = pytest.mark.usefixtures("one_thread")

BS = 16
POOL_BLOCKS = 24  # 384 tokens: one conversation's turn fits, two do not
CONVERSATIONS, TURNS, NEW_TOKENS = 3, 3, 8


def converse(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """Each round sends every conversation its next turn (its previous prompt, the answer and a
    new message); returns every turn's output tokens and cached tokens, in order."""
    firsts = random_prompts([150, 170, 190], seed=21)
    messages = random_prompts([20] * (CONVERSATIONS * TURNS), seed=22)
    history = list(firsts)
    outs, cached = [], []
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            (out,) = llm.generate([history[c]], greedy(NEW_TOKENS), use_tqdm=False)
            tokens = out.outputs[0].token_ids
            outs.append(tokens)
            cached.append(out.num_cached_tokens)
            history[c] = history[c] + tokens + messages[turn * CONVERSATIONS + c]
    return outs, cached


def test_greedy_tokens_are_the_same_with_the_tier_and_later_turns_restore(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    per_block, common = tier_settings(model_dir, POOL_BLOCKS, BS)
    off = LLM(model_dir, **common)
    assert off.engine.block_manager.num_blocks == POOL_BLOCKS
    want, cached_off = converse(off)
    assert_no_leaks(off.engine)

    cap = 40 * per_block  # less than the conversations' blocks together (about 60)
    on = LLM(model_dir, kv_host_tier_bytes=cap, **common)
    got, cached_on = converse(on)
    assert got == want  # greedy tokens identical with the tier on and off
    bm = on.engine.block_manager
    tier = bm.tier
    assert tier is not None and tier.capacity_bytes == cap
    assert tier.restored > 0 and bm.hit_tokens_host > 0
    assert tier.peak_bytes <= cap and tier.bytes <= cap
    # the later turns find their prefix (restored from the tier) where the tierless engine
    # recomputed it
    assert sum(cached_on[CONVERSATIONS:]) > sum(cached_off[CONVERSATIONS:])
    assert all(cached_on[i] > 0 for i in range(CONVERSATIONS, len(cached_on)))
    assert_no_leaks(on.engine)
    # idle: a reset frees the cache and the tier alike
    assert on.engine.block_manager.reset_prefix_cache()
    assert tier.bytes == 0 and len(tier) == 0


def test_the_option_is_validated(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    with pytest.raises(ValueError, match="kv_host_tier_bytes"):
        LLM(model_dir, kv_cache_memory=KV, kv_host_tier_bytes=-1)
    with pytest.raises(ValueError, match="kv_host_tier_bytes"):
        LLM(model_dir, kv_cache_memory=KV, kv_host_tier_bytes=1 << 20, enable_prefix_caching=False)
