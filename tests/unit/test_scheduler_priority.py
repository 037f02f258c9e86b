"""Priority scheduling in the engine's scheduler (vLLM's semantics: lower value first, first come
first served within equal values), with the fake runner of scheduler_harness.py: the waiting
queue's order, which running sequence is preempted first under KV pressure, and that equal
priorities keep the plain FCFS behaviour."""

from __future__ import annotations

from helpers.scheduler_harness import Harness, sched_view
from pdserve.engine.request import SeqStatus


def _add(h: Harness, prompt, priority: int, **params):
    seq = h.new(prompt, **params)
    seq.priority = priority
    h.seqs.append(seq)
    h.sched.add([seq])
    h.check()
    return seq


def test_waiting_queue_is_in_priority_order_fcfs_within_equal():
    h = Harness(num_blocks=64, block_size=4, caching=False, budget=64, max_num_seqs=1)
    a = _add(h, range(10, 14), 10, max_tokens=2, ignore_eos=True)
    b = _add(h, range(20, 24), 0, max_tokens=2, ignore_eos=True)
    c = _add(h, range(30, 34), 10, max_tokens=2, ignore_eos=True)
    d = _add(h, range(40, 44), 0, max_tokens=2, ignore_eos=True)
    e = _add(h, range(50, 54), -5, max_tokens=2, ignore_eos=True)
    assert list(h.sched.waiting) == [e, b, d, a, c]
    order = []
    while h.sched.num_unfinished:
        plan = h.step()
        for item in plan.scheduled:
            if item.seq not in order:
                order.append(item.seq)
    assert order == [e, b, d, a, c]  # one at a time (max_num_seqs=1): admitted in that order
    h.assert_no_leaks()


def test_equal_priorities_keep_fcfs_and_preempt_the_last_admitted():
    # the same run as test_scheduler_preemption's, every sequence at priority 7
    h = Harness(num_blocks=9, block_size=4, caching=False, budget=64, max_num_seqs=3)
    a, b, c, d = (
        _add(h, range(10 * i, 10 * i + 8), 7, max_tokens=8, ignore_eos=True) for i in range(1, 5)
    )
    plan = h.step()
    assert sched_view(plan) == [(a.seq_id, 0, 8), (b.seq_id, 0, 8), (c.seq_id, 0, 8)]
    for _ in range(4):
        h.step()
    plan = h.step()
    assert sched_view(plan) == [(a.seq_id, 12, 1), (b.seq_id, 12, 1)]
    assert list(h.sched.waiting) == [c, d]  # the preempted one first within its priority
    h.run()
    h.assert_no_leaks()


def test_preemption_victim_is_the_lowest_priority_not_the_last_admitted():
    h = Harness(num_blocks=9, block_size=4, caching=False, budget=64, max_num_seqs=3)
    a = _add(h, range(10, 18), 0, max_tokens=8, ignore_eos=True)
    b = _add(h, range(20, 28), 5, max_tokens=8, ignore_eos=True)  # the lowest priority
    c = _add(h, range(30, 38), 0, max_tokens=8, ignore_eos=True)  # admitted last
    d = _add(h, range(40, 48), 5, max_tokens=8, ignore_eos=True)
    plan = h.step()
    # a, c (priority 0) then b; d waits
    assert sched_view(plan) == [(a.seq_id, 0, 8), (c.seq_id, 0, 8), (b.seq_id, 0, 8)]
    for _ in range(4):
        h.step()
    assert h.bm.num_free_blocks == 0 and h.sched.num_preemptions == 0
    plan = h.step()
    # a needs a 4th block: b (priority 5) is preempted, not c (the last admitted, priority 0)
    assert h.sched.num_preemptions == 1
    assert b.status == SeqStatus.WAITING and c.status == SeqStatus.RUNNING
    assert sched_view(plan) == [(a.seq_id, 12, 1), (c.seq_id, 12, 1)]
    # b goes back in front of d (same priority, arrived later)
    assert list(h.sched.waiting) == [b, d]
    h.run()
    assert [x.num_output_tokens for x in (a, b, c, d)] == [8, 8, 8, 8]
    h.assert_no_leaks()


def test_a_higher_priority_running_sequence_is_planned_first():
    # budget for one prompt at a time: the priority-0 one admitted later runs ahead of the
    # priority-9 one already running in the next step's plan order
    h = Harness(num_blocks=64, block_size=4, caching=False, budget=64, max_num_seqs=4)
    low = _add(h, range(10, 18), 9, max_tokens=4, ignore_eos=True)
    h.step()
    high = _add(h, range(20, 28), 0, max_tokens=4, ignore_eos=True)
    h.step()
    plan = h.step()
    assert [s.seq for s in plan.scheduled] == [high, low]
    h.run()
    h.assert_no_leaks()
