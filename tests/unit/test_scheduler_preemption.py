"""Scheduler preemption by recompute, with the fake runner of scheduler_harness.py (no model):
which sequence is preempted, where it is requeued, the admission watermark, and what a preempted
sequence recomputes with and without the prefix cache."""

from __future__ import annotations

from helpers.scheduler_harness import Harness, sched_view
from pdserve.engine.request import FinishReason, SeqStatus

# ---- preemption by recompute -----------------------------------------------------------------


def _preemption_run(num_blocks):
    h = Harness(num_blocks=num_blocks, block_size=4, caching=False, budget=64, max_num_seqs=2)
    a = h.add(range(10, 18), max_tokens=12, ignore_eos=True)[0]
    b = h.add(range(20, 28), max_tokens=12, ignore_eos=True)[0]
    c = h.add(range(30, 34), max_tokens=2, ignore_eos=True)[0]
    return h, a, b, c


def test_preemption_by_recompute():
    ref, ra, rb, rc = _preemption_run(num_blocks=64)
    ref.run()
    assert ref.sched.num_preemptions == 0

    h, a, b, c = _preemption_run(num_blocks=8)
    for _ in range(9):
        plan = h.step()
        assert sched_view(plan) == [
            (a.seq_id, plan.scheduled[0].start, plan.scheduled[0].num_new_tokens),
            (b.seq_id, plan.scheduled[1].start, plan.scheduled[1].num_new_tokens),
        ]
    assert a.num_tokens == b.num_tokens == 17 and h.bm.num_free_blocks == 0
    assert h.sched.num_preemptions == 0
    plan = h.step()
    # a needs a 5th block and none is free: the LAST running sequence (b) is preempted
    assert h.sched.num_preemptions == 1
    assert sched_view(plan) == [(a.seq_id, 16, 1)]
    assert b.status == SeqStatus.WAITING and b.block_ids == [] and b.num_computed_tokens == 0
    assert [s.seq_id for s in h.sched.waiting] == [b.seq_id, c.seq_id]  # front of the queue
    assert b.num_output_tokens == 9
    assert h.bm.num_free_blocks == 3
    while a.status != SeqStatus.FINISHED:
        plan = h.step()
        assert b.seq_id not in [s.seq.seq_id for s in plan.scheduled]
    plan = h.step()
    # readmitted ahead of c; recomputes prompt + its 9 outputs in one chunk and samples
    assert sched_view(plan)[0] == (b.seq_id, 0, 17)
    assert plan.row_seqs[0] is b
    h.run()
    assert h.sched.num_preemptions == 1
    for x, y in ((a, ra), (b, rb), (c, rc)):
        assert x.finish_reason == y.finish_reason == FinishReason.LENGTH
        assert x.token_ids == y.token_ids
    assert b.num_output_tokens == 12
    h.assert_no_leaks()


def test_preemption_picks_the_last_running_sequence_and_requeues_it_first():
    h = Harness(num_blocks=9, block_size=4, caching=False, budget=64, max_num_seqs=3)
    a, b, c, d = (
        h.add(range(10 * i, 10 * i + 8), max_tokens=8, ignore_eos=True)[0] for i in range(1, 5)
    )
    plan = h.step()
    assert sched_view(plan) == [(a.seq_id, 0, 8), (b.seq_id, 0, 8), (c.seq_id, 0, 8)]
    assert list(h.sched.waiting) == [d]
    for k in range(4):
        plan = h.step()
        assert sched_view(plan) == [(x.seq_id, 8 + k, 1) for x in (a, b, c)]
    assert h.bm.num_free_blocks == 0 and h.sched.num_preemptions == 0
    plan = h.step()
    # a needs a 4th block: c (last) is preempted, never b; c's 3 blocks serve a and b
    assert sched_view(plan) == [(a.seq_id, 12, 1), (b.seq_id, 12, 1)]
    assert h.sched.num_preemptions == 1
    assert list(h.sched.waiting) == [c, d]
    assert c.block_ids == [] and c.num_computed_tokens == 0 and c.num_output_tokens == 5
    assert h.bm.num_free_blocks == 1
    h.step()
    plan = h.step()  # a and b get their 8th token and finish
    assert sched_view(plan) == [(a.seq_id, 14, 1), (b.seq_id, 14, 1)]
    assert a.is_finished and b.is_finished
    plan = h.step()
    # c first (prompt + 4 outputs recomputed, then samples), then d
    assert sched_view(plan) == [(c.seq_id, 0, 13), (d.seq_id, 0, 8)]
    h.run()
    assert [x.num_output_tokens for x in (a, b, c, d)] == [8, 8, 8, 8]
    h.assert_no_leaks()


def test_admission_keeps_a_watermark_but_reservation_does_not():
    h = Harness(num_blocks=8, block_size=4, caching=False, budget=64)
    assert h.sched.watermark_blocks == 1
    a = h.add(range(10, 26), max_tokens=2, ignore_eos=True)[0]  # 4 blocks
    h.step()
    assert h.bm.num_free_blocks == 4
    b = h.add(range(30, 46), max_tokens=1)[0]  # 4 more: would leave 0 free
    plan = h.step()
    assert sched_view(plan) == [(a.seq_id, 16, 1)] and b.status == SeqStatus.WAITING
    assert a.is_finished
    h.run()
    assert b.num_output_tokens == 1
    h.assert_no_leaks()
    # a prompt that needs the whole pool is never admitted, but can be reserved
    huge = h.add(range(100, 132), max_tokens=1)[0]
    assert h.step().is_empty and huge.status == SeqStatus.WAITING
    h.finish(huge)
    h.assert_no_leaks()
    big = h.new(range(100, 132), max_tokens=1)
    h.reserve(big)
    assert h.bm.num_free_blocks == 0
    h.finish(big)
    h.assert_no_leaks()


def test_preemption_with_prefix_cache_recomputes_only_the_uncached_tail():
    h = Harness(num_blocks=8, block_size=4, caching=True, budget=64, max_num_seqs=2)
    a = h.add(range(10, 18), max_tokens=12, ignore_eos=True)[0]
    b = h.add(range(20, 28), max_tokens=12, ignore_eos=True)[0]
    while h.sched.num_preemptions == 0:
        h.step()
    assert b.status == SeqStatus.WAITING
    while b.status == SeqStatus.WAITING:
        plan = h.step()
    # b's computed full blocks that a did not evict while b waited are served from the cache
    (item,) = [s for s in plan.scheduled if s.seq is b]
    assert item.start == b.num_cached_tokens > 0
    assert b.num_cached_tokens % 4 == 0
    assert item.end == b.num_computed_tokens == b.num_tokens - 1  # sampled at the end
    h.run()
    assert a.num_output_tokens == b.num_output_tokens == 12
    h.assert_no_leaks()


def test_running_sequence_preempts_itself_when_alone_and_short_of_blocks():
    # a reservation holds most of the pool; the only running sequence cannot grow
    h = Harness(num_blocks=4, block_size=4, caching=False, budget=64)
    a = h.add(range(10, 14), max_tokens=3, ignore_eos=True)[0]
    h.step()
    assert a.num_tokens == 5 and len(a.block_ids) == 1
    r = h.new(range(30, 42), max_tokens=1)
    h.reserve(r)
    assert h.bm.num_free_blocks == 0
    plan = h.step()
    assert plan.scheduled == [] and a.status == SeqStatus.WAITING
    assert h.sched.num_preemptions == 1
    h.finish(r)
    h.run()
    assert a.num_output_tokens == 3
    h.assert_no_leaks()
