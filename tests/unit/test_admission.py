"""The router's admission queue (router/admission.py) without a server: FIFO hand-off of freed
slots, the max_queued and max_wait_s bounds, a deadline that comes first, a client that leaves
while queued, and the wait each admission reports. The clock is a fake one the test moves; the
waits that must time out run on threads bounded by generous wall-clock limits."""

from __future__ import annotations

import threading
import time

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
# how long a pause test lets a waiting thread run before it checks the thread still waits (a
# wrong outcome would come at once; the right one is to go on waiting, however long this is)
SETTLE_S = 0.2


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


# ---- the servicer's admission (router/service.py) with a fake gRPC context ---------------------
class _Aborted(Exception):
    pass


class FakeContext:
    """What PDServeServicer._admit uses of a grpc.ServicerContext; `ended`: the RPC had already
    ended, so add_callback takes no callback (gRPC's rule)."""

    def __init__(self, ended: bool = False):
        self.ended, self.callbacks, self.status = ended, [], None

    def add_callback(self, fn) -> bool:
        if self.ended:
            return False
        self.callbacks.append(fn)
        return True

    def abort(self, code, details):
        self.status = (code, details)
        raise _Aborted(details)

    def invocation_metadata(self):
        return ()  # an interactive call: no batch's mark (router/admission.py)


def _servicer(max_wait_s: float = 600.0):
    from pdserve.router.service import PDServeServicer, ServiceOptions

    servicer = object.__new__(PDServeServicer)  # only what _admit uses: no pool, no workers
    servicer.options = ServiceOptions(
        model_id="m", max_model_len=16, vocab_size=8, dtype="float32", max_queue_wait_s=max_wait_s
    )
    servicer._inflight, servicer._lock = {}, threading.Lock()
    servicer.admission = Admission(1, 4, max_wait_s)
    return servicer


def test_a_queued_call_whose_rpc_already_ended_leaves_at_once():
    import grpc

    servicer = _servicer()
    servicer.admission.enter()  # the one slot is taken
    context, out = FakeContext(ended=True), []

    def admit():
        try:
            servicer._admit(("peer", "r1"), object(), context, deadline=None)
        except _Aborted:
            out.append(context.status[0])

    t = threading.Thread(target=admit, daemon=True)
    t.start()
    t.join(WALL_S)  # it would otherwise wait max_wait_s (600 s) holding a queue place
    assert out == [grpc.StatusCode.CANCELLED] and servicer.admission.queued() == 0


def test_the_servicer_maps_each_outcome_to_its_status():
    import grpc

    servicer = _servicer(max_wait_s=0.05)
    servicer.admission.enter()
    context = FakeContext()
    with pytest.raises(_Aborted):
        servicer._admit(("peer", "r1"), object(), context, deadline=None)
    assert context.status[0] == grpc.StatusCode.UNAVAILABLE
    assert "max_queue_wait_s=0.05" in context.status[1] and context.callbacks
    servicer.admission = Admission(1, 0, 600.0)
    servicer.admission.enter()
    with pytest.raises(_Aborted):
        servicer._admit(("peer", "r2"), object(), context, deadline=None)
    assert context.status[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queued=0" in context.status[1]
    servicer.admission.leave()
    servicer._admit(("peer", "r3"), "call", context, deadline=None)  # a free slot: admitted
    assert servicer._inflight == {("peer", "r3"): "call"}
    servicer.admission = Admission(2, 0, 600.0)
    with pytest.raises(_Aborted):  # the same request_id twice on one connection
        servicer._admit(("peer", "r3"), "again", context, deadline=None)
    assert context.status[0] == grpc.StatusCode.ALREADY_EXISTS
    assert servicer.admission.running() == 0  # the refused call gave its slot back


# ---- pause (router/pause.py) ---------------------------------------------------------------------
def test_a_pause_holds_every_new_call_and_resume_admits_them_in_order():
    clock, waits = FakeClock(), []
    a = admission(max_inflight=2, max_queued=3, max_wait_s=5.0, clock=clock, waits=waits)
    running = a.enter()
    a.pause()
    assert running.granted and a.is_paused and not a.idle()
    held = [a.enter(), a.enter()]  # a slot is free, and still they queue
    assert not any(t.granted for t in held) and a.queued() == 2
    clock.now += 60.0  # far past max_wait_s: paused, the waits do not time out
    threads = [waiter(a, t) for t in held]
    time.sleep(SETTLE_S)
    assert all(out == [] for _, out in threads) and a.queued() == 2
    a.leave()  # the freed slot goes to nobody while paused
    assert a.idle() and a.running() == 0 and not held[0].granted
    a.resume()
    for t, out in threads:
        t.join(WALL_S)
        assert out == [ADMITTED]
    assert not a.is_paused and a.running() == 2 and a.queued() == 0
    assert waits[-2:] == [pytest.approx(60.0)] * 2  # the wait reported is the whole wait


def test_time_paused_does_not_count_towards_max_wait_s_but_a_deadline_does():
    clock = FakeClock()
    a = admission(max_inflight=1, max_queued=3, max_wait_s=5.0, clock=clock)
    a.enter()
    before = a.enter()  # queued at 100, 3 s before the pause
    clock.now += 3.0
    a.pause()
    clock.now += 100.0
    late = a.enter()
    assert a.wait(late, deadline=clock.now - 1.0) == DEADLINE  # its own deadline still ends it
    a.resume()  # `before` has waited 3 s unpaused of its 5
    t, out = waiter(a, before)
    time.sleep(SETTLE_S)
    assert out == [] and a.queued() == 1
    clock.now += 1.0
    a.leave()  # 4 s unpaused: still queued, it takes the slot
    t.join(WALL_S)
    assert out == [ADMITTED] and before.granted
    after = a.enter()  # queued after the pause: its 5 s run as before
    clock.now += 5.0
    assert a.wait(after) == TIMED_OUT and a.queued() == 0


def test_a_client_gone_while_paused_leaves_the_queue():
    a = admission(max_queued=2)
    a.pause()
    gone = a.enter()
    t, out = waiter(a, gone)  # paused, no deadline: it waits until woken
    a.cancel(gone)
    t.join(WALL_S)
    assert out == [CANCELLED] and a.queued() == 0 and a.idle()
    a.resume()
    assert a.running() == 0


def test_the_gate_opens_only_when_no_client_and_no_update_holds_it():
    from pdserve.router.pause import RouterPause

    a = admission()
    pause = RouterPause(a, abort_all=lambda: 0, enabled=True)
    pause.pause("wait")  # a client's /pause, then a weight update under it
    pause.hold("wait")
    pause.release()
    assert a.is_paused  # the update ending does not undo the client's pause
    pause.resume()
    assert not a.is_paused
    pause.hold("wait")  # two updates at once: the first to end leaves the gate closed
    pause.hold("wait")
    pause.release()
    assert a.is_paused
    pause.release()
    assert not a.is_paused
    pause.hold("wait")
    pause.resume()  # a client's /resume does not open a gate an update holds
    assert a.is_paused
    pause.release(keep=True)  # keep_pause: now the client's, until /resume
    assert a.is_paused
    pause.resume()
    assert not a.is_paused
