"""Priority order in the router's two queues (vLLM's: lower value first, first come first served
within equal values): the admission queue (router/admission.py) hands freed slots out in that
order, and the decode-KV wait queue (router/decode_queue.py) puts its tickets in that order, a
request that was already trying in front of its own priority only; the router's scheduling
policy refuses a non-zero priority under fcfs, naming the field."""

from __future__ import annotations

import grpc

from pdserve.router.admission import Admission
from pdserve.router.decode_queue import DecodeQueue
from pdserve.router.service import check_priority


def test_admission_hands_freed_slots_to_the_lowest_priority_value_fcfs_within_equal():
    a = Admission(1, 10, 60.0, clock=lambda: 0.0)
    running = a.enter(0)
    assert running.granted
    queued = [(p, a.enter(p)) for p in (10, 0, 10, -3, 0)]
    order, holder = [], running
    for _ in queued:
        a.leave(holder)  # the slot goes to the queue's head
        granted = [(p, t) for p, t in queued if t.granted and t not in [x for _, x in order]]
        assert len(granted) == 1
        order.append(granted[0])
        holder = granted[0][1]
    assert [p for p, _ in order] == [-3, 0, 0, 10, 10]
    # within equal priorities, in arrival order
    assert [t for p, t in order if p == 0] == [t for p, t in queued if p == 0]
    assert [t for p, t in order if p == 10] == [t for p, t in queued if p == 10]


def test_admission_with_every_priority_zero_is_first_come_first_served():
    a = Admission(1, 10, 60.0, clock=lambda: 0.0)
    holder = a.enter()
    queued = [a.enter() for _ in range(4)]
    for i in range(4):
        a.leave(holder)
        assert [t.granted for t in queued] == [j <= i for j in range(4)]
        holder = queued[i]


def test_a_batch_call_queues_behind_every_interactive_call_whatever_the_priorities():
    """A Batch API line's call (background) never takes a freed slot an interactive call waits
    for, even one that came later with a larger priority value; batch calls keep their own
    priority order and arrival order among themselves."""
    a = Admission(1, 10, 60.0, clock=lambda: 0.0)
    holder = a.enter(background=True)
    assert holder.granted  # a free slot, nobody waiting: taken at once
    arrivals = [
        ("batch-a", a.enter(0, background=True)),
        ("batch-low", a.enter(5, background=True)),
        ("late", a.enter(10)),
        ("batch-b", a.enter(0, background=True)),
        ("later", a.enter(0)),
    ]
    order = []
    for _ in arrivals:
        a.leave(holder)
        order += [n for n, t in arrivals if t.granted and n not in order]
        holder = dict(arrivals)[order[-1]]
    assert order == ["later", "late", "batch-a", "batch-b", "batch-low"]


def test_decode_queue_orders_tickets_by_priority_and_keeps_retries_first_in_their_class():
    q = DecodeQueue()
    late_low = q.join(priority=10)
    zero_a = q.join(priority=0)
    zero_b = q.join(priority=0)
    retry_zero = q.join(first=True, priority=0)  # was already trying: first among its class
    retry_low = q.join(first=True, priority=10)
    urgent = q.join(priority=-1)
    assert list(q._tickets) == [urgent, retry_zero, zero_a, zero_b, retry_low, late_low]
    assert q.head(urgent, timeout=0)
    q.leave(urgent)
    assert q.head(retry_zero, timeout=0) and not q.head(zero_a, timeout=0)
    for t in (retry_zero, zero_a, zero_b, retry_low, late_low):
        q.leave(t)
    assert q.waiting() == 0


def test_fcfs_policy_refuses_a_priority_naming_the_field():
    assert check_priority(0, "fcfs") is None
    assert check_priority(7, "priority") is None and check_priority(-7, "priority") is None
    refusal = check_priority(5, "fcfs")
    assert refusal.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refusal.message.startswith("priority=5") and "scheduling_policy" in refusal.message
