"""A hybrid model's recurrent states in the host tier (engine/kv_host_tier.py save_state,
load_state; engine/recurrent_state.py SlotPool.on_push_out, claim; engine/scheduler.py
_with_state, _save_state). A hybrid's prefix hit needs the state after its last block, which the
engine keeps in a free slot, and slots are few: a kept state that loses its slot (or whose block
leaves the KV cache) goes to the tier, and a later prompt on that prefix gets it back.

Here the tier, the slots and their hand-offs on their own, and one engine case: a state pushed
out before the copy that fills its slot ran is not saved. Conversations that outgrow the slots
on three kinds of hybrid, and on two tensor-parallel ranks, are in
tests/integration/test_hybrid_host_tier_engines.py."""

from __future__ import annotations

import pytest
import torch

from helpers.arch import arch_refs
from helpers.engine import KV, greedy
from helpers.hybrid_turns import NEW, check_greedy, hf_greedy
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM
from pdserve.engine.kv_host_tier import MIN_ENTRY_BYTES, HostTier, fingerprint
from pdserve.engine.recurrent_state import RecurrentStates, SlotPool

pytestmark = pytest.mark.usefixtures("one_thread")
FP = fingerprint(dict(model="m", dtype="float32", block_size=4), 2)
SHAPES = [((3, 8), (2, 4, 4)), ((3, 6), (3, 2, 2))]  # two layers' (conv, ssm) on one rank


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    cache: dict = {}
    return lambda kind: arch_refs(tmp_path_factory, cache, kind)


def _ranks(seed: int) -> list[RecurrentStates]:
    """Two ranks' states, 4 slots each, filled with distinct values."""
    g = torch.Generator().manual_seed(seed)
    ranks = [RecurrentStates(SHAPES, 4, "cpu") for _ in range(2)]
    for st in ranks:
        for t in (*st.conv, *st.ssm):
            t.copy_(torch.randn(t.shape, generator=g))
    return ranks


def _slot(ranks, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for st in ranks for t in (*st.conv, *st.ssm)]


def test_a_state_saved_from_one_slot_comes_back_into_another_on_every_rank():
    ranks = _ranks(0)
    per_state = sum(RecurrentStates.bytes_for(SHAPES, 1) for _ in ranks)
    tier = HostTier(3 * per_state, lambda: [], FP, states=lambda: ranks)
    want = _slot(ranks, 1)
    assert tier.save_state(77, 1) == (True, [])
    assert tier.has_state(77) and tier.bytes == per_state and tier.states_stored == 1
    assert tier.save_state(77, 2) == (False, [])  # held already: only touched
    for st in ranks:  # the slots' bytes are gone: only the tier has them
        for t in (*st.conv, *st.ssm):
            t[1].zero_()
    other = _slot(ranks, 0)
    assert tier.load_state(77, 3)
    assert all(torch.equal(a, b) for a, b in zip(_slot(ranks, 3), want))
    assert all(torch.equal(a, b) for a, b in zip(_slot(ranks, 0), other))  # (nothing else)
    assert tier.states_restored == 1 and tier.has_state(77)  # the tier keeps its copy
    assert not tier.load_state(78, 3) and not tier.contains(77)  # (a state is not a block)
    assert tier.stats()["kv_host_tier_states_restored"] == 1


def test_a_state_whose_bytes_changed_is_refused_and_nothing_written():
    ranks = _ranks(1)
    tier = HostTier(1 << 20, lambda: [], FP, states=lambda: ranks)
    tier.save_state(5, 0)
    tier._entries[(FP, 5, "state")].shards[1].view(-1)[3] += 1.0  # rank 1's, one value
    before = _slot(ranks, 2)
    assert not tier.load_state(5, 2)
    assert tier.states_refused == 1 and not tier.has_state(5) and tier.bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(_slot(ranks, 2), before))
    # one saved under another layout (a rank's part of another size) is refused too
    tier.save_state(6, 0)
    tier._entries[(FP, 6, "state")].shards[0] = torch.zeros(5)
    assert not tier.load_state(6, 2) and tier.states_refused == 2


def test_states_and_blocks_share_one_cap_and_one_lru():
    """A state pushed out of the cap is dropped and named nowhere; blocks it pushes out are
    returned, as a block's save returns them (the block manager reports them removed)."""
    ranks = _ranks(2)
    cache = torch.randn(1, 2, 4, 4, 1, 16)  # a KV pool of 4 blocks, 512 bytes a block
    per_state = sum(RecurrentStates.bytes_for(SHAPES, 1) for _ in ranks)
    tier = HostTier(per_state + 512, lambda: [cache], FP, watermark=1.0, states=lambda: ranks)
    assert tier.save(11, None, (1, 2, 3, 4), 0) == (True, [])
    assert tier.save_state(11, 0) == (True, [])  # (both fit exactly)
    assert tier.save_state(12, 1) == (True, [11])  # the block (oldest) and the state go
    assert not tier.contains(11) and not tier.has_state(11) and tier.has_state(12)
    assert tier.save(13, None, (5, 6, 7, 8), 1) == (True, [])  # (fits beside it)
    assert tier.save(14, 13, (9, 9, 9, 9), 2) == (True, [])  # a state pushed out: no hash
    assert not tier.has_state(12) and tier.bytes == 1024 and len(tier) == 2
    assert tier.hashes() == [13, 14]  # (the KV events' view: blocks only)
    assert tier.save_state(14, 2) == (True, [13])
    assert tier.clear() == [14] and tier.bytes == 0 and not tier.has_state(14)


def test_blocks_of_no_bytes_still_count_against_the_cap():
    """A model with no KV layer (Falcon Mamba) has blocks of no bytes: each entry counts
    MIN_ENTRY_BYTES, so the tier's entries stay bounded."""
    cache = torch.zeros(0, 2, 4, 4, 1, 2)
    tier = HostTier(4 * MIN_ENTRY_BYTES, lambda: [cache], FP, watermark=1.0)
    for h in range(10):
        tier.save(h, None, (h,), 0)
    assert len(tier) == 4 and tier.bytes == 4 * MIN_ENTRY_BYTES
    assert tier.capacity_blocks == 4 and tier.hashes() == [6, 7, 8, 9]


def test_a_slot_pool_hands_states_leaving_their_slots_to_the_tier():
    """on_push_out sees every kept state that loses its slot for want of room or with its
    block; a state replaced or refused (drop) is not handed; claim never takes a busy slot."""
    pool, pushed = SlotPool(3), []
    pool.on_push_out = lambda h, slot: pushed.append((h, slot))
    assert pool.keep(101) == 0 and pool.keep(102) == 1 and pool.keep(103) == 2
    assert pool.take() == 0 and pushed == [(101, 0)]  # (no plain free slot: the oldest goes)
    assert pool.spare() == 1 and pushed[-1] == (102, 1)
    pool.push_out(103)
    assert pushed[-1] == (103, 2) and pool.num_free == 1 and pool.num_kept == 0
    pool.give_back(0)
    assert pool.claim(201, busy={2}) == 0 and 201 in pool  # the plain free one not busy
    assert pool.claim(202, busy={2}) == 0 and pushed[-1] == (201, 0)  # then a kept state's
    assert pool.claim(203, busy={0, 2}) is None and 203 not in pool
    pool.drop(202)
    assert len(pushed) == 4 and pool.num_free == 2  # (a drop hands nothing on)


def test_a_state_whose_copy_is_still_pending_is_not_saved(refs):
    """Turn 1 (39 tokens and 10 new) keeps its state at 48 in its last step's update: the copy
    into the kept slot is made as the next step starts. Two prompts admitted together then take
    both slots, pushing that state out before its copy ran: its slot's bytes are an older
    state's, and the tier must not keep them under 48's hash. Turn 2 starts from the state kept
    at the prompt's boundary (36) instead, and gets HF's tokens."""
    from helpers.models import random_prompts

    model_dir, hf, *_ = refs("qwen3.5")
    probe = LLM(model_dir, kv_cache_memory=KV, block_size=4)
    per_slot = probe.engine.runner._state_bytes // probe.engine.runner.states.num_slots
    probe.shutdown()
    llm = LLM(
        model_dir,
        kv_cache_memory=4 * per_slot + 3 * per_slot // 2,
        kv_host_tier_bytes=64 * per_slot,
        block_size=4,
        max_num_batched_tokens=64,
        max_model_len=96,
        speculative_config=None,
    )
    try:
        scheduler = llm.engine.scheduler
        first, b, c, new = random_prompts([39, 20, 24, 5], seed=9)
        (out1,) = llm.generate([first], greedy(NEW, logprobs=0), use_tqdm=False)
        at_48 = llm.engine.block_manager.chain(first + out1.outputs[0].token_ids, 12)[-1]
        pending = [dst for _, dst in scheduler._pending_state_copies]
        assert pending == [scheduler.slots.kept(at_48)]
        llm.generate([b, c], greedy(NEW), use_tqdm=False)
        assert at_48 not in scheduler.slots and not llm.engine.block_manager.tier.has_state(at_48)
        second = first + out1.outputs[0].token_ids + new
        assert llm.engine.block_manager.held_prefix_tokens(second, len(second) - 1) == 36
        (out2,) = llm.generate([second], greedy(NEW, logprobs=0), use_tqdm=False)
        assert out2.num_cached_tokens == 36
        check_greedy(out2, hf_greedy(hf, second, NEW))
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
