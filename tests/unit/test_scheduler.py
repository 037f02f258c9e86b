"""Scheduler + BlockManager with a fake runner (no model): chunked prefill, the token budget and
admission order, prefix caching through the scheduler, and stop conditions.

The fake runner and its KV/prefix-cache checks are in scheduler_harness.py; preemption is in
test_scheduler_preemption.py, n > 1 forks, reserve/commit and aborts in
test_scheduler_fork_reserve.py, the random-operation property tests in test_scheduler_property.py.
"""

from __future__ import annotations

import pytest

from helpers.scheduler_harness import EOS, Harness, sched_view
from pdserve.engine.request import FinishReason, SeqStatus

# ---- chunked prefill -------------------------------------------------------------------------


def test_chunked_prefill_then_decode():
    h = Harness(num_blocks=16, block_size=16, budget=32)
    (seq,) = h.add(range(2, 102), max_tokens=3, ignore_eos=True)
    for start, n in ((0, 32), (32, 32), (64, 32)):
        plan = h.step()
        assert sched_view(plan) == [(seq.seq_id, start, n)]
        assert plan.rows == [] and plan.row_seqs == []  # mid-prompt: nothing sampled
        assert seq.num_computed_tokens == start + n
        assert seq.num_output_tokens == 0
    assert len(seq.block_ids) == 7  # the whole prompt was allocated up front
    plan = h.step()
    assert sched_view(plan) == [(seq.seq_id, 96, 4)]
    assert plan.row_seqs == [seq] and plan.row_logits == [0]
    assert seq.num_computed_tokens == 100 and seq.num_output_tokens == 1
    for k in range(2):
        plan = h.step()
        assert sched_view(plan) == [(seq.seq_id, 100 + k, 1)]
        assert plan.row_seqs == [seq]
        assert seq.num_computed_tokens == 101 + k
    assert seq.status == SeqStatus.FINISHED and seq.finish_reason == FinishReason.LENGTH
    assert seq.num_output_tokens == 3
    assert h.step().is_empty
    h.assert_no_leaks()


# ---- budget, order, admission ----------------------------------------------------------------


def test_budget_shared_running_before_waiting_fcfs_and_max_num_seqs():
    h = Harness(num_blocks=64, block_size=4, budget=10, max_num_seqs=2)
    a = h.add(range(10, 16), max_tokens=4, ignore_eos=True)[0]
    b = h.add(range(20, 26), max_tokens=4, ignore_eos=True)[0]
    c = h.add(range(30, 36), max_tokens=4, ignore_eos=True)[0]
    plan = h.step()
    # FCFS: a whole, b gets what is left of the budget, c waits (max_num_seqs=2)
    assert sched_view(plan) == [(a.seq_id, 0, 6), (b.seq_id, 0, 4)]
    assert [s.seq_id for s in h.sched.waiting] == [c.seq_id]
    assert c.status == SeqStatus.WAITING and c.block_ids == []
    plan = h.step()
    # running first: a's decode and the rest of b's prompt; c still waits
    assert sched_view(plan) == [(a.seq_id, 6, 1), (b.seq_id, 4, 2)]
    assert plan.row_seqs == [a, b] and plan.row_logits == [0, 1]
    h.step()
    h.step()  # a gets its 4th token and finishes
    assert a.status == SeqStatus.FINISHED and a.num_output_tokens == 4
    plan = h.step()
    assert sched_view(plan) == [(b.seq_id, 8, 1), (c.seq_id, 0, 6)]  # decode before admission
    h.run()
    assert [s.num_output_tokens for s in (a, b, c)] == [4, 4, 4]
    h.assert_no_leaks()


def test_decodes_take_the_budget_before_admissions():
    h = Harness(num_blocks=64, block_size=4, budget=4, max_num_seqs=8)
    running = [h.add([10 + i], max_tokens=10, ignore_eos=True)[0] for i in range(4)]
    plan = h.step()
    assert sched_view(plan) == [(s.seq_id, 0, 1) for s in running]
    late = h.add(range(50, 58), max_tokens=1)[0]
    for _ in range(3):
        plan = h.step()
        # the four decodes use the whole budget: the newcomer is not admitted
        assert sched_view(plan) == [(s.seq_id, s.num_computed_tokens - 1, 1) for s in running]
        assert late.status == SeqStatus.WAITING
    for s in running[1:]:
        h.finish(s, FinishReason.ABORT)
    plan = h.step()
    assert sched_view(plan) == [(running[0].seq_id, 4, 1), (late.seq_id, 0, 3)]
    h.finish(running[0])
    h.run()
    assert late.num_output_tokens == 1
    h.assert_no_leaks()


def test_admission_waits_for_blocks_and_keeps_fcfs():
    # 8 blocks, watermark 1: the first prompt takes 6 blocks, the second (3 blocks) cannot be
    # admitted, and a later small one must not jump the queue
    h = Harness(num_blocks=8, block_size=4, budget=64, max_num_seqs=8, caching=False)
    a = h.add(range(10, 34), max_tokens=2, ignore_eos=True)[0]
    b = h.add(range(40, 52), max_tokens=1)[0]
    c = h.add([60], max_tokens=1)[0]
    plan = h.step()
    assert sched_view(plan) == [(a.seq_id, 0, 24)]
    assert [s.seq_id for s in h.sched.waiting] == [b.seq_id, c.seq_id]
    assert h.bm.num_free_blocks == 2
    plan = h.step()  # a finishes
    assert a.status == SeqStatus.FINISHED
    plan = h.step()
    assert sched_view(plan) == [(b.seq_id, 0, 12), (c.seq_id, 0, 1)]
    h.run()
    h.assert_no_leaks()


# ---- prefix caching through the scheduler ----------------------------------------------------


@pytest.mark.parametrize("first_alive", [True, False])
def test_prefix_cache_hit_shares_full_blocks(first_alive):
    prompt = list(range(100, 164))
    h = Harness(num_blocks=32, block_size=16, budget=256)
    a = h.add(prompt, max_tokens=20 if first_alive else 1, ignore_eos=True)[0]
    h.step()
    assert a.num_hashed_blocks == 4
    if not first_alive:
        assert a.status == SeqStatus.FINISHED
    b = h.add(prompt, max_tokens=2, ignore_eos=True)[0]
    free_before, a_before = h.bm.num_free_blocks, len(a.block_ids)
    plan = h.step()
    free_before -= len(a.block_ids) - a_before  # a's own decode block, if any
    # 3 cached blocks; the 4th is recomputed so the last prompt token yields logits
    assert b.num_cached_tokens == 48
    item = [s for s in plan.scheduled if s.seq is b][0]
    assert (item.start, item.num_new_tokens) == (48, 16)
    assert b.block_ids[:3] == a_blocks(h, prompt)[:3]
    assert b.block_ids[3] not in a_blocks(h, prompt)
    if first_alive:
        assert b.block_ids[:3] == a.block_ids[:3]
        assert [h.bm.ref_count(x) for x in b.block_ids] == [2, 2, 2, 1]
        assert h.bm.num_free_blocks == free_before - 1  # only the recomputed block is new
    else:
        assert [h.bm.ref_count(x) for x in b.block_ids] == [1, 1, 1, 1]
        assert h.bm.num_free_blocks == free_before - 4  # 3 revived + 1 new
    h.finish(a)
    h.run()
    h.assert_no_leaks()


def a_blocks(h, prompt):
    """The block ids the cache serves for `prompt` (full 64 tokens)."""
    return h.bm.find_cached_prefix(prompt, len(prompt))


def test_prefix_cache_off_never_shares():
    prompt = list(range(100, 164))
    h = Harness(num_blocks=32, block_size=16, budget=256, caching=False)
    a = h.add(prompt, max_tokens=20, ignore_eos=True)[0]
    h.step()
    b = h.add(prompt, max_tokens=2, ignore_eos=True)[0]
    plan = h.step()
    assert b.num_cached_tokens == 0 and b.num_computed_tokens == 64
    assert [s for s in plan.scheduled if s.seq is b][0].start == 0
    assert not set(a.block_ids) & set(b.block_ids)
    h.finish(a)
    h.run()
    h.assert_no_leaks()


def test_prefix_cache_partial_hit_and_decoded_blocks_are_cached():
    h = Harness(num_blocks=32, block_size=4, budget=256)
    a = h.add(range(10, 18), max_tokens=9, ignore_eos=True)[0]
    h.run()
    # a computed 16 tokens (its last sampled token never runs): its decoded tokens filled
    # blocks 2 and 3, so a prompt equal to a's text hits them
    assert a.num_tokens == 17
    b = h.add(a.token_ids[:16] + [99, 98], max_tokens=1)[0]
    h.step()
    assert b.num_cached_tokens == 16
    e = h.add(a.token_ids[:15], max_tokens=1)[0]
    h.step()
    assert e.num_cached_tokens == 12  # only whole blocks, within num_tokens - 1
    c = h.add(list(range(10, 18)) + [7, 7, 7, 7], max_tokens=1)[0]
    h.step()
    assert c.num_cached_tokens == 8  # stops at the first differing block
    h.run()
    h.assert_no_leaks()


def test_same_prompt_admitted_together_then_decoded_blocks_chain_correctly():
    """a and b prefill the same prompt in one step, so b's prompt blocks duplicate a's and are not
    registered. b's later decoded block must be cached under b's real chain (found by a prompt equal
    to b's text), never as the first block of an unrelated prompt."""
    h = Harness(num_blocks=32, block_size=4, budget=256)
    prompt = list(range(10, 18))
    h.add(prompt, max_tokens=1)
    b = h.add(prompt, max_tokens=5, ignore_eos=True)[0]
    h.run()
    assert b.num_tokens == 13 and b.num_hashed_blocks == 3
    tail = b.token_ids[8:12]
    # the tail block of b at position 0 of another prompt: not served
    c = h.add(tail + [5, 5], max_tokens=1)[0]
    h.step()
    assert c.num_cached_tokens == 0
    # b's whole text: all three blocks served
    d = h.add(b.token_ids[:12] + [5], max_tokens=1)[0]
    h.step()
    assert d.num_cached_tokens == 12
    h.run()
    h.assert_no_leaks()


# ---- stops ------------------------------------------------------------------------------------


def scripted(script):
    """Fake runner tokens: the k-th output token of each sequence is script[k]."""
    return lambda seq: script[seq.num_output_tokens]


@pytest.mark.parametrize(
    "params, script, n_out, reason, stop_reason",
    [
        (dict(max_tokens=10), [5, 6, EOS, 7], 3, FinishReason.STOP, None),
        (dict(max_tokens=10), [EOS], 1, FinishReason.STOP, None),
        (dict(max_tokens=5, ignore_eos=True), [EOS] * 6, 5, FinishReason.LENGTH, None),
        (dict(max_tokens=10, min_tokens=3), [EOS, EOS, EOS, 5], 3, FinishReason.STOP, None),
        (dict(max_tokens=10, min_tokens=3), [EOS, 5, 6, 7, EOS, 8], 5, FinishReason.STOP, None),
        (dict(max_tokens=10, stop_token_ids=[7]), [5, 7, 8], 2, FinishReason.STOP, 7),
        (dict(max_tokens=10, stop_token_ids=[7], min_tokens=2), [7, 7, 8], 2, FinishReason.STOP, 7),
        (
            dict(max_tokens=10, stop_token_ids=[7], ignore_eos=True),
            [EOS, 7],
            2,
            FinishReason.STOP,
            7,
        ),
        (dict(max_tokens=3), [5, 6, 8, 9], 3, FinishReason.LENGTH, None),
        (dict(max_tokens=3), [5, 6, EOS], 3, FinishReason.STOP, None),
        (dict(max_tokens=1), [5], 1, FinishReason.LENGTH, None),
    ],
)
def test_stop_conditions(params, script, n_out, reason, stop_reason):
    h = Harness(token_fn=scripted(script))
    (seq,) = h.add(range(10, 16), **params)
    h.run()
    assert seq.num_output_tokens == n_out
    assert seq.output_token_ids == script[:n_out]
    assert (seq.finish_reason, seq.stop_reason) == (reason, stop_reason)
    h.assert_no_leaks()


def test_max_model_len_finishes_with_length():
    h = Harness(max_model_len=13)
    (seq,) = h.add(range(10, 20), max_tokens=100, ignore_eos=True)
    h.run()
    assert seq.num_tokens == 13 and seq.num_output_tokens == 3
    assert seq.finish_reason == FinishReason.LENGTH
    h.assert_no_leaks()


def test_prefill_only_finishes_after_first_token():
    h = Harness()
    (seq,) = h.add(range(10, 20), max_tokens=100)
    seq.prefill_only = True
    h.run()
    assert seq.num_output_tokens == 1 and seq.finish_reason == FinishReason.PREFILL_DONE
    h.assert_no_leaks()


def test_a_growing_sequence_continues_its_run_of_blocks():
    """A decode that needs a block takes the one after its last in memory when that one is free
    (BlockManager.allocate's `after`), not the free queue's head: the attention kernel reads a
    sequence's blocks in order, and consecutive blocks come from memory up to twice as fast."""
    h = Harness(num_blocks=32, block_size=4, caching=False)
    # a free queue in no order: every even block from 20 first, then the rest
    taken = h.bm.allocate(32)
    order = list(range(20, 32, 2)) + [b for b in range(32) if not (b >= 20 and b % 2 == 0)]
    h.bm.free(order[::-1])  # (free puts a sequence's blocks back tail first)
    assert len(taken) == 32 and list(h.bm._free)[:3] == [20, 22, 24]
    (seq,) = h.add(range(2, 10), max_tokens=8, ignore_eos=True)
    h.step()
    assert seq.block_ids == [20, 22]  # the queue's head, in ascending order
    held = []
    while not h.step().is_empty:
        held = list(seq.block_ids) or held  # (a finished sequence's table is emptied)
    # the queue's head would have given 24 and 26; the blocks after 22 were free
    assert held == [20, 22, 23, 24]
    h.assert_no_leaks()
