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
    FAIRNESS_ID_KEY,
    SHED,
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
    a.leave(first)  # the head gets the slot; no later arrival overtakes it
    threads[0][0].join(WALL_S)
    assert threads[0][1] == [ADMITTED] and not queued[1].granted and a.running() == 2
    assert waits[-1] == pytest.approx(2.0)
    late = a.enter()  # a new arrival queues behind the two still waiting
    assert not late.granted and a.queued() == 3
    a.leave(second)
    a.leave(queued[0])
    for t, out in threads[1:]:
        t.join(WALL_S)
        assert out == [ADMITTED]
    assert queued[1].granted and queued[2].granted and a.running() == 2
    a.cancel(late)
    assert a.wait(late) == CANCELLED and a.queued() == 0
    a.leave(queued[1])
    a.leave(queued[2])
    assert a.running() == 0


def test_a_call_that_waits_max_wait_s_times_out_and_leaves_the_queue():
    clock = FakeClock()
    a = admission(max_wait_s=5.0, clock=clock)
    held = a.enter()
    ticket = a.enter()
    clock.now += 5.0  # the fake clock has passed the bound: the wait ends at once
    assert a.wait(ticket) == TIMED_OUT
    assert a.queued() == 0 and a.running() == 1
    a.leave(held)
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
    held = a.enter()
    gone, next_ = a.enter(), a.enter()
    t, out = waiter(a, gone)
    a.cancel(gone)  # what gRPC's end-of-call callback does
    t.join(WALL_S)
    assert out == [CANCELLED] and a.queued() == 1
    a.leave(held)  # the slot skips the gone call and goes to the next one
    assert next_.granted and a.wait(next_) == ADMITTED and a.running() == 1


def test_granted_then_cancelled_hands_the_slot_on():
    a = admission(max_queued=2)
    held = a.enter()
    raced, after = a.enter(), a.enter()
    a.leave(held)  # raced is granted ...
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


# ---- fairness between tenants and flows ----------------------------------------------------------
def _run_fifo(a: Admission, running: list, steps: int) -> None:
    """Ends the oldest running call `steps` times (calls finishing in the order they started),
    adding each call the queue grants to `running`."""
    for _ in range(steps):
        done = running.pop(0)
        waiting = {t for t in a._tickets_locked()}
        a.leave(done)
        running += [t for t in waiting if t.granted]


def test_a_tenant_with_nothing_running_takes_the_next_slot_ahead_of_a_flood():
    a = admission(max_inflight=4, max_queued=100)
    flood = [a.enter(flow=("A", "")) for _ in range(54)]
    assert all(t.granted for t in flood[:4]) and a.queued() == 50
    light = a.enter(flow=("B", ""))
    assert not light.granted and a.tenants_waiting() == 2
    a.leave(flood[0])  # the first slot freed goes to B, not to A's oldest waiting call
    assert light.granted and not flood[4].granted
    a.leave(flood[1])  # B now runs one, A three: A's oldest is next
    assert flood[4].granted and not flood[5].granted


def test_backlogged_tenants_converge_on_equal_shares_of_the_slots():
    a = admission(max_inflight=6, max_queued=200)
    running = [a.enter(flow=("A", "")) for _ in range(6)]
    for _ in range(60):
        a.enter(flow=("A", ""))
    for _ in range(20):
        a.enter(flow=("B", ""))
    _run_fifo(a, running, 12)
    shares = [sum(t.flow[0] == name for t in running) for name in "AB"]
    assert shares == [3, 3] and a.running() == 6


def test_a_key_that_names_many_flows_gets_one_tenants_share():
    """A tenant's sub-flows (x-gateway-inference-fairness-id) share that tenant's slots: a key
    naming five flows holds as many slots as a key with one; its flows take turns."""
    a = admission(max_inflight=4, max_queued=200)
    running = [a.enter(flow=("one", "")) for _ in range(4)]
    for i in range(50):
        a.enter(flow=("many", f"user-{i % 5}"))
    for _ in range(20):
        a.enter(flow=("one", ""))
    granted_many = []
    for _ in range(30):
        before = {id(t) for t in running}
        _run_fifo(a, running, 1)
        granted_many += [t.flow[1] for t in running if id(t) not in before and t.flow[0] == "many"]
        assert abs(sum(t.flow[0] == "many" for t in running) - 2) <= 1
    assert sum(t.flow[0] == "many" for t in running) == 2
    # the five flows in turn: each of them was granted, none twice before the others once
    assert sorted(granted_many[:5]) == [f"user-{i}" for i in range(5)]


def test_the_slot_goes_to_the_tenant_running_fewest_not_in_turn():
    """A tenant whose requests run long holds no more slots for it: B, granted after A, gets
    the slot its call freed back before A, which runs three."""
    a = admission(max_inflight=4, max_queued=10)
    held_a = [a.enter(flow=("A", "")) for _ in range(3)]
    held_b = a.enter(flow=("B", ""))
    a_next, b_next = a.enter(flow=("A", "")), a.enter(flow=("B", ""))
    a.leave(held_b)  # A: 3 running, granted before B; B: none running
    assert b_next.granted and not a_next.granted
    a.leave(held_a[0])
    assert a_next.granted


def test_priority_and_batch_classes_come_before_fairness():
    a = admission(max_inflight=1, max_queued=10)
    held = a.enter(flow=("A", ""))
    b_batch = a.enter(0, background=True, flow=("B", ""))
    b_late = a.enter(5, flow=("B", ""))
    a_urgent = a.enter(-1, flow=("A", ""))  # A already runs one: still first, by its priority
    a.leave(held)
    assert a_urgent.granted and not b_late.granted
    a.leave(a_urgent)
    assert b_late.granted and not b_batch.granted
    a.leave(b_late)
    assert b_batch.granted


def test_a_full_queue_sheds_the_flooding_tenants_newest_call_for_another_tenant():
    a = admission(max_inflight=1, max_queued=5)
    held = a.enter(flow=("A", ""))
    flood = [a.enter(flow=("A", "")) for _ in range(5)]
    with pytest.raises(QueueFull, match="max_queued=5"):
        a.enter(flow=("A", ""))  # A has the most waiting itself: no one gives way
    first = a.enter(flow=("B", ""))
    assert flood[4].shed and a.wait(flood[4]) == SHED and a.queued() == 5
    a.enter(flow=("B", ""))  # A 4 waiting, B 1: A gives way again
    assert flood[3].shed and a.tenants_waiting() == 2
    with pytest.raises(QueueFull):  # A 3, B 2: giving way would only turn the two around
        a.enter(flow=("B", ""))
    assert not flood[2].shed
    a.leave(held)
    assert first.granted  # and the shed calls were never granted
    assert not flood[3].granted and not flood[4].granted and a.queued() == 4


def test_a_full_queue_sheds_within_a_tenant_and_never_a_better_placed_call():
    a = admission(max_inflight=1, max_queued=3)
    a.enter(flow=("", ""))
    crowd = [a.enter(flow=("", "")) for _ in range(3)]  # no keys: one tenant, flows by header
    other = a.enter(flow=("", "user-2"))
    assert crowd[2].shed and not other.shed and a.queued() == 3
    with pytest.raises(QueueFull):  # 2 and 1 waiting: giving way would turn the two around
        a.enter(flow=("", "user-2"))
    assert not crowd[1].shed
    b = admission(max_inflight=1, max_queued=3)
    b.enter(flow=("A", ""))
    urgent = [b.enter(-5, flow=("A", "")) for _ in range(3)]
    with pytest.raises(QueueFull):  # A's waiting calls are placed better than the arrival
        b.enter(0, flow=("B", ""))
    assert not any(t.shed for t in urgent)


def test_start_tags_keep_a_tenants_order_and_put_a_newcomer_first():
    """Past the admission the workers' queues order calls by priority, then start tag: one
    tenant's tags rise in the order its calls were admitted (first come, first served for a
    deployment of one tenant), and a tenant that joins while another runs many starts at the
    lowest tag running, ahead of everything the other has queued on the workers."""
    a = admission(max_inflight=8, max_queued=100)
    flood = [a.enter(flow=("A", "")) for _ in range(8)]
    assert [t.tag for t in flood] == list(range(8))
    running = flood[:]
    for _ in range(20):
        a.enter(flow=("A", ""))
    _run_fifo(a, running, 5)  # A's oldest five end; five more of A's are admitted
    assert sorted(t.tag for t in running) == list(range(5, 13))
    quiet = a.enter(flow=("B", ""))
    _run_fifo(a, running, 1)
    # the lowest tag running, A's oldest's (admitted before it: ahead at the tie), and before
    # A's 7 to 12
    assert quiet.granted and quiet.tag == 6
    assert sorted(t.tag for t in running if t.flow[0] == "A") == list(range(6, 13))
    running.remove(quiet)
    a.leave(quiet)  # B has nothing left: its next call starts afresh at the lowest tag running
    again = a.enter(flow=("B", ""))
    _run_fifo(a, running, 1)
    assert again.granted and again.tag == min(t.tag for t in running)


def test_without_keys_each_flow_has_tags_of_its_own():
    a = admission(max_inflight=4, max_queued=10)
    crowd = [a.enter(flow=("", "")) for _ in range(4)]
    a.enter(flow=("", ""))
    other = a.enter(flow=("", "user-2"))
    a.leave(crowd[0])
    assert other.granted and other.tag == 1  # not behind the crowd's 1 to 3
    one = admission(max_inflight=4, max_queued=10)
    calls = [one.enter(flow=("K", f"user-{i}")) for i in range(4)]
    assert [t.tag for t in calls] == [0, 1, 2, 3]  # a key's flows share its tags


def test_engine_priority_orders_by_priority_then_tag():
    from pdserve.protos.convert import engine_priority

    keys = [(-5, 9), (-5, 10), (0, 0), (0, (1 << 64) - 1), (3, 0)]
    assert sorted(keys, key=lambda k: engine_priority(*k)) == keys
    assert engine_priority(7) >> 64 == 7 and engine_priority(-2, 5) >> 64 == -2


def test_the_queue_keeps_no_record_of_a_tenant_that_has_left():
    a = admission(max_inflight=2, max_queued=10)
    tickets = [a.enter(flow=(f"t{i}", f"f{i}")) for i in range(6)]
    a.cancel(tickets[3])
    assert a.wait(tickets[3]) == CANCELLED
    a.cancel(tickets[4])  # its wait never runs: the queue skips it when its turn comes
    for t in tickets[:2]:
        a.leave(t)
    for t in tickets[2:]:
        if t.granted:
            a.leave(t)
    assert a.running() == 0 and a.queued() == 0
    assert a._tenants == {} and a._flows == {} and a._waiting == {}
    assert a._next_tag == {} and a._running_tags == {}
    b = admission(max_inflight=1, max_queued=10)  # without keys: the flows are the units
    held = b.enter(flow=("", "user-1"))
    waiting = b.enter(flow=("", "user-2"))
    b.leave(held)  # user-1 has left: its record goes, though the tenant "" still has user-2
    assert set(b._next_tag) == {"user-2"}
    b.leave(waiting)
    assert b._next_tag == {} and b._tenants == {}


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
    servicer.tenants_by_key = False
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
    held = servicer.admission.enter()
    with pytest.raises(_Aborted):
        servicer._admit(("peer", "r2"), object(), context, deadline=None)
    assert context.status[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queued=0" in context.status[1]
    servicer.admission.leave(held)
    servicer._admit(("peer", "r3"), "call", context, deadline=None)  # a free slot: admitted
    assert servicer._inflight == {("peer", "r3"): "call"}
    servicer.admission = Admission(2, 0, 600.0)
    with pytest.raises(_Aborted):  # the same request_id twice on one connection
        servicer._admit(("peer", "r3"), "again", context, deadline=None)
    assert context.status[0] == grpc.StatusCode.ALREADY_EXISTS
    assert servicer.admission.running() == 0  # the refused call gave its slot back


class MetadataContext(FakeContext):
    def __init__(self, metadata):
        super().__init__()
        self.metadata = tuple(metadata)

    def invocation_metadata(self):
        return self.metadata


def test_the_flow_is_a_hash_of_the_key_and_the_fairness_id():
    import grpc

    from pdserve.router.service import flow_of

    key_a, key_b = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"
    a1 = flow_of(MetadataContext([("authorization", f"Bearer {key_a}")]))
    a2 = flow_of(MetadataContext([("authorization", f"bearer {key_a}"), (FAIRNESS_ID_KEY, "u7")]))
    b = flow_of(MetadataContext([("authorization", f"Bearer {key_b}")]))
    assert a1[0] == a2[0] != b[0] and a1[1] == "" and a2[1] == "u7"
    assert key_a not in a1[0] and len(a1[0]) == 32  # the key itself is never kept
    assert flow_of(MetadataContext([])) == ("", "")
    # a deployment without keys checks no key: every client is one tenant
    assert flow_of(MetadataContext([("authorization", f"Bearer {key_a}")]), False) == ("", "")
    assert flow_of(MetadataContext([(FAIRNESS_ID_KEY, "team-x")])) == ("", "team-x")
    context = MetadataContext([(FAIRNESS_ID_KEY, "x" * 129)])
    with pytest.raises(_Aborted):
        flow_of(context)
    assert context.status[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert FAIRNESS_ID_KEY in context.status[1] and "128" in context.status[1]


def test_the_servicer_queues_each_call_in_its_flow_and_answers_a_shed_call():
    import grpc

    servicer = _servicer()
    servicer.admission = Admission(1, 2, 600.0)
    held = servicer.admission.enter(flow=("", ""))
    out, threads = {}, []

    def admit(name, flow_id):
        context = MetadataContext([(FAIRNESS_ID_KEY, flow_id)])
        try:
            out[name] = servicer._admit(("peer", name), object(), context, deadline=None)
        except _Aborted:
            out[name] = context.status

    def start(name, flow_id, queued):
        threads.append(threading.Thread(target=admit, args=(name, flow_id), daemon=True))
        threads[-1].start()
        wait_for(lambda: servicer.admission.queued() == queued)

    start("a1", "a", 1)
    start("a2", "a", 2)
    assert {t.flow for t in servicer.admission._tickets_locked()} == {("", "a")}
    start("b1", "b", 2)  # the queue is full: flow a's newest call gives way to flow b's
    wait_for(lambda: "a2" in out)
    code, message = out["a2"]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "took its place" in message
    servicer.admission.leave(held)
    wait_for(lambda: len(out) == 2)
    first = "a1" if "a1" in out else "b1"
    servicer.admission.leave(out[first])
    for t in threads:
        t.join(WALL_S)
    second = ({"a1", "b1"} - {first}).pop()
    servicer.admission.leave(out[second])
    assert servicer.admission.running() == 0 and servicer.admission.queued() == 0


def wait_for(condition) -> None:
    deadline = time.monotonic() + WALL_S
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true"
        time.sleep(0.005)


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
    a.leave(running)  # the freed slot goes to nobody while paused
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
    held = a.enter()
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
    a.leave(held)  # 4 s unpaused: still queued, it takes the slot
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
