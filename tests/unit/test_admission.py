"""The router's admission queue (router/admission.py) without a server: FIFO hand-off of freed
slots, the max_queued and max_wait_s bounds, a deadline that comes first, a client that leaves
while queued, and the wait each admission reports. The clock is a fake one the test moves; the
waits that must time out run on threads bounded by generous wall-clock limits."""

from __future__ import annotations

import threading

import pytest

from helpers.deploy_config import error_of, write
from pdserve.deploy.config.load import load_config
from pdserve.router.admission import (
    ADMITTED,
    CANCELLED,
    DEADLINE,
    TIMED_OUT,
    Admission,
    QueueFull,
)
from pdserve.router.server import PASSED_TO_SERVICE, RouterConfig

WALL_S = 30.0  # a bound on how long a thread may take to see its outcome; never a speed claim


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def admission(max_inflight=1, max_queued=2, max_wait_s=5.0, clock=None, waits=None):
    return Admission(
        max_inflight,
        max_queued,
        max_wait_s,
        clock=clock or FakeClock(),
        on_admit=(waits.append if waits is not None else lambda s: None),
    )


def waiter(a: Admission, ticket, deadline=None) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(a.wait(ticket, deadline)), daemon=True)
    t.start()
    return t, out


def test_free_slots_admit_at_once_and_freed_slots_go_to_the_queue_in_order():
    clock, waits = FakeClock(), []
    a = admission(max_inflight=2, max_queued=3, clock=clock, waits=waits)
    first, second = a.enter(), a.enter()
    assert first.granted and second.granted and a.running() == 2 and waits == [0.0, 0.0]
    queued = [a.enter() for _ in range(3)]
    assert not any(t.granted for t in queued) and a.queued() == 3
    with pytest.raises(QueueFull, match="max_queued=3"):
        a.enter()
    threads = [waiter(a, t) for t in queued]
    clock.now += 2.0
    a.leave()  # the head gets the slot; no later arrival overtakes it
    threads[0][0].join(WALL_S)
    assert threads[0][1] == [ADMITTED] and not queued[1].granted and a.running() == 2
    assert waits[-1] == pytest.approx(2.0)
    late = a.enter()  # a new arrival queues behind the two still waiting
    assert not late.granted and a.queued() == 3
    a.leave()
    a.leave()
    for t, out in threads[1:]:
        t.join(WALL_S)
        assert out == [ADMITTED]
    assert queued[1].granted and queued[2].granted and a.running() == 2
    a.cancel(late)
    assert a.wait(late) == CANCELLED and a.queued() == 0
    a.leave()
    a.leave()
    assert a.running() == 0


def test_a_call_that_waits_max_wait_s_times_out_and_leaves_the_queue():
    clock = FakeClock()
    a = admission(max_wait_s=5.0, clock=clock)
    a.enter()
    ticket = a.enter()
    clock.now += 5.0  # the fake clock has passed the bound: the wait ends at once
    assert a.wait(ticket) == TIMED_OUT
    assert a.queued() == 0 and a.running() == 1
    a.leave()
    assert a.running() == 0


def test_a_deadline_before_max_wait_s_ends_the_wait_as_deadline():
    clock = FakeClock()
    a = admission(max_wait_s=5.0, clock=clock)
    a.enter()
    ticket = a.enter()
    clock.now += 2.0
    assert a.wait(ticket, deadline=clock.now - 1.0) == DEADLINE and a.queued() == 0


def test_a_real_wait_ends_after_max_wait_s():
    a = Admission(1, 1, 0.05)  # the real clock: the wait must end by itself
    a.enter()
    ticket = a.enter()
    t, out = waiter(a, ticket)
    t.join(WALL_S)
    assert out == [TIMED_OUT] and a.queued() == 0


def test_a_client_gone_while_queued_leaves_and_its_slot_is_not_taken():
    a = admission(max_queued=2)
    a.enter()
    gone, next_ = a.enter(), a.enter()
    t, out = waiter(a, gone)
    a.cancel(gone)  # what gRPC's end-of-call callback does
    t.join(WALL_S)
    assert out == [CANCELLED] and a.queued() == 1
    a.leave()  # the slot skips the gone call and goes to the next one
    assert next_.granted and a.wait(next_) == ADMITTED and a.running() == 1


def test_granted_then_cancelled_hands_the_slot_on():
    a = admission(max_queued=2)
    a.enter()
    raced, after = a.enter(), a.enter()
    a.leave()  # raced is granted ...
    a.cancel(raced)  # ... and its client leaves before its handler sees it
    assert a.wait(raced) == CANCELLED
    assert after.granted and a.wait(after) == ADMITTED and a.running() == 1


def test_zero_queue_refuses_past_max_inflight_and_bad_bounds_are_refused():
    a = admission(max_inflight=1, max_queued=0)
    a.enter()
    with pytest.raises(QueueFull):
        a.enter()
    for bad in ((0, 1, 1.0), (1, -1, 1.0), (1, 1, 0.0)):
        with pytest.raises(ValueError, match="Admission needs"):
            Admission(*bad)


# ---- the YAML keys and the router's config -------------------------------------------------------
@pytest.mark.parametrize(
    "text, key",
    [
        ("router:\n  max_queued: -1\n", "router.max_queued"),
        ("router:\n  max_queued: 9000\n", "router.max_queued"),
        ("router:\n  max_queued: many\n", "router.max_queued"),
        ("router:\n  max_queue_wait_s: 0\n", "router.max_queue_wait_s"),
    ],
)
def test_bad_queue_keys_name_the_key(tmp_path, text, key):
    path = write(tmp_path, "model: smollm2\n" + text)
    assert error_of(path).startswith(f"{path}: {key}: ")


def test_queue_keys_default_and_reach_the_router(tmp_path):
    cfg = load_config(write(tmp_path, "model: smollm2\n"))
    assert (cfg.router.max_queued, cfg.router.max_queue_wait_s) == (1024, 60.0)
    cfg = load_config(
        write(tmp_path, "model: smollm2\nrouter:\n  max_queued: 0\n  max_queue_wait_s: 2.5\n")
    )
    assert (cfg.router.max_queued, cfg.router.max_queue_wait_s) == (0, 2.5)
    assert "max_queued" in PASSED_TO_SERVICE and "max_queue_wait_s" in PASSED_TO_SERVICE
    for bad in (dict(max_queued=-1), dict(max_queue_wait_s=0.0)):
        with pytest.raises(ValueError, match="RouterConfig.max_queue"):
            RouterConfig(model="smollm2", **bad)
