"""A hybrid model's prefix cache (engine/scheduler.py _with_state, _keep_state;
engine/recurrent_state.py SlotPool): a prompt's cached blocks serve its attention layers, and its
recurrent layers start from the state the cache kept (in a free slot) after the last of them:
the state at the last block boundary before a prompt's end, and at the latest boundary a
sequence passed after its prompt (where a conversation's next turn continues). A hit on blocks
without a kept state starts the recurrent layers over, from the prompt's first token. Each
against HF's greedy tokens, for Gated DeltaNet (Qwen3.5), Mamba2 (Granite 4.0-H) and Mamba
(Falcon Mamba: no KV at all, its scan split where a state is kept)."""

from __future__ import annotations

import pytest

from helpers.arch import arch_refs
from helpers.engine import KV, greedy
from helpers.hybrid_turns import NEW, check_greedy, hf_greedy
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.recurrent_state import NoFreeSlots, SlotPool
from pdserve.engine.scheduler import StepOutput

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    cache: dict = {}
    return lambda kind: arch_refs(tmp_path_factory, cache, kind)


@pytest.mark.parametrize("kind", ["qwen3.5", "granite-4.0-h", "falcon-mamba"])
def test_next_turn_starts_from_the_kept_state(refs, kind):
    """Turn 1 (37 prompt tokens in chunks of 32 and 5, 10 new: 46 computed) keeps the states at
    36 (the prompt's last boundary, inside its second chunk) and 44 (past the prompt; 40's was
    replaced). Turn 2 (turn 1's tokens and 5 more) is served 44 tokens from the cache, turn 1's
    prompt again 36; a prompt that leaves turn 1's tokens at 30 finds 28 tokens of blocks but no
    state after them, and starts over."""
    model_dir, hf, *_ = refs(kind)
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=4, max_num_batched_tokens=32)
    try:
        first = list(range(40, 77))
        out1 = llm.generate(first, greedy(NEW, logprobs=0), use_tqdm=False)[0]
        check_greedy(out1, hf_greedy(hf, first, NEW))
        slots = llm.engine.scheduler.slots
        assert slots.num_kept == 2
        second = first + out1.outputs[0].token_ids + [5, 6, 7, 8, 9]
        bm = llm.engine.block_manager  # (what a decode worker's local prefill check reads)
        assert bm.held_prefix_tokens(second, len(second) - 1) == 44
        out2 = llm.generate(second, greedy(NEW, logprobs=0), use_tqdm=False)[0]
        assert out2.num_cached_tokens == 44
        check_greedy(out2, hf_greedy(hf, second, NEW))
        other = first[:30] + [200 + i for i in range(12)]
        assert bm.held_prefix_tokens(other, len(other) - 1) == 0  # (28 tokens' blocks, no state)
        out1b = llm.generate(first, greedy(NEW, logprobs=0), use_tqdm=False)[0]
        assert out1b.num_cached_tokens == 36
        check_greedy(out1b, hf_greedy(hf, first, NEW))
        out3 = llm.generate(other, greedy(NEW, logprobs=0), use_tqdm=False)[0]
        assert out3.num_cached_tokens == 0
        check_greedy(out3, hf_greedy(hf, other, NEW))
        assert_no_leaks(llm.engine)
        # what a peer fetch sends with the blocks: the whole state kept after 44's block
        at_44 = llm.engine.block_manager.chain(second, 11)[-1]
        assert len(llm.engine.read_kept_state(at_44)) == llm.engine.state_bytes()
        # a reset drops the kept states with the blocks
        assert llm.engine.reset_prefix_cache() > 0 and slots.num_kept == 0
        again = llm.generate(second, greedy(NEW, logprobs=0), use_tqdm=False)[0]
        assert again.num_cached_tokens == 0
        check_greedy(again, hf_greedy(hf, second, NEW))
    finally:
        llm.shutdown()


def test_preemption_beside_kept_states(refs):
    """Half the memory's slots (all of them: the prefix cache keeps states in the idle ones) and
    too few KV blocks for two long prompts at once: a sequence is preempted while free slots
    keep states, readmitted over whatever the cache still holds, and HF's tokens come out."""
    model_dir, _, prompts, want = refs("qwen3.5")
    shape = dict(max_model_len=200, max_num_seqs=2, block_size=4, max_num_batched_tokens=64)
    probe = LLM(model_dir, kv_cache_memory=KV, **shape)
    engine = probe.engine
    per_slot = engine.runner._state_bytes // engine.runner.states.num_slots
    per_block = engine.kv_cache[:, :, 0].numel() * engine.kv_cache.element_size()
    probe.shutdown()
    kv = 120 * per_block
    llm = LLM(model_dir, kv_cache_memory=kv, **shape)
    try:
        assert llm.engine.runner.state_slots == kv // 2 // per_slot >= 2
        assert llm.engine.block_manager.num_blocks < 71
        longest = [4, 3, 7]  # (150, 100 and 89 tokens: 71 blocks for the first two at once)
        outs = llm.generate([prompts[i] for i in longest], greedy(len(want[0])), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [want[i] for i in longest]
        assert llm.engine.scheduler.num_preemptions > 0
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


def test_kept_states_give_way_to_sequences():
    """A kept state lies in a free slot until a sequence needs it: plain free slots go first,
    then the least recently used kept states; a slot a pending copy reads is avoided."""
    pool = SlotPool(3)
    assert pool.keep(101) == 0 and pool.keep(102) == 1
    assert pool.keep(101) is None  # (kept already: the same tokens reach the same state)
    assert pool.num_free == 3 and pool.num_kept == 2
    assert pool.take() == 2  # the plain free slot first
    assert pool.kept(101) == 0  # 101 is now the most recently used
    pool.avoid = {1}
    assert pool.take() == 0 and 101 not in pool  # (102's slot is avoided: 101's goes)
    pool.avoid = set()
    with pytest.raises(NoFreeSlots):
        SlotPool(0).take()
    pool.drop(102)
    assert pool.num_kept == 0 and pool.take() == 1
    pool.give_back(1)
    assert pool.keep(103) == 1
    pool.clear()
    assert pool.num_kept == 0 and pool.num_free == 1


def test_an_evicted_block_takes_its_kept_state_along():
    """The block manager drops the state kept after a block it evicts (its slot is plain free
    again), and a reset of the prefix cache drops them all."""
    bm, pool = BlockManager(2, 4), SlotPool(2)
    bm.kept_states = pool
    blocks = bm.allocate(2)
    tokens = list(range(8))
    assert bm.register_full_blocks(blocks, tokens, 0, 8, None) == 2
    first, second = (bm.blocks[b].hash for b in blocks)
    assert pool.keep(first) is not None and pool.keep(second) is not None
    bm.free(blocks)
    bm.allocate(1)  # (evicts one of the two cached blocks: the least recently freed)
    assert (first in pool) != (second in pool) and pool.num_kept == 1
    assert pool.num_free == 2
    bm.free([b for b in blocks if bm.ref_count(b)])
    assert bm.reset_prefix_cache() and pool.num_kept == 0


def test_a_state_kept_for_an_aborted_sequence_is_given_back(refs):
    """A step that keeps a prompt's state mid-chunk holds a spare slot until it has run; a
    sequence aborted meanwhile gives that slot back with its own."""
    model_dir, *_ = refs("qwen3.5")
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=4, max_num_batched_tokens=64)
    try:
        engine, scheduler = llm.engine, llm.engine.scheduler
        engine.add_request("a", list(range(40, 77)), greedy(NEW))
        plan = scheduler.schedule()
        (item,) = plan.scheduled
        assert (item.keep_at, item.keep_slot >= 0) == (36, True)
        assert scheduler.slots.num_free == scheduler.slots.num_slots - 2
        assert engine.abort("a")
        scheduler.update(plan, StepOutput(token_ids=[7]))
        assert scheduler.slots.num_kept == 0
        assert_no_leaks(engine)
    finally:
        llm.shutdown()


def test_the_last_free_slot_holding_the_start_state_is_taken_over(refs):
    """Two slots: turn 1 leaves one plain free and the other keeping its state at 44. A prompt
    admitted first takes the plain one; turn 2, admitted in the same step, finds only the slot
    of the state it starts from free, and takes it over as it is (no copy), HF's tokens still."""
    model_dir, hf, *_ = refs("qwen3.5")
    probe = LLM(model_dir, kv_cache_memory=KV)
    per_slot = probe.engine.runner._state_bytes // probe.engine.runner.states.num_slots
    probe.shutdown()
    kv = 4 * per_slot + 3 * per_slot // 2  # (two slots in half of it, four allocated for probes)
    llm = LLM(
        model_dir, kv_cache_memory=kv, block_size=4, max_num_batched_tokens=32, max_model_len=96
    )
    try:
        slots = llm.engine.scheduler.slots
        assert slots.num_slots == 2
        first = list(range(40, 77))
        out1 = llm.generate(first, greedy(NEW, logprobs=0), use_tqdm=False)[0]
        assert slots.num_kept == 1  # (44's: with no slot left, 36's and 40's gave way)
        second = first + out1.outputs[0].token_ids + [5, 6, 7, 8, 9]
        other = [200 + i for i in range(12)]
        out_other, out2 = llm.generate([other, second], greedy(NEW, logprobs=0), use_tqdm=False)
        assert out2.num_cached_tokens == 44
        check_greedy(out2, hf_greedy(hf, second, NEW))
        check_greedy(out_other, hf_greedy(hf, other, NEW))
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
