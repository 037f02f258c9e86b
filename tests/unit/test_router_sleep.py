"""The cluster's sleep mode (router/sleep.py) and its HTTP endpoints (router/openai/sleep.py), with
fake workers and no sockets: a sleep holds every request at the router (a client's /resume cannot
open the gate while the cluster sleeps), then puts every live worker to sleep at once; a worker
that refuses makes the sleep fail whole, naming it and its engine's reason, with the others put
back and the gate open again; a staged wake (weights, then kv_cache) keeps the gate closed until
the last tag wakes; a worker that fails to wake leaves its tags asleep; a deeper sleep is taken,
a shallower one answers the state; level 0 asks no worker; one operation at a time. Over HTTP:
vLLM's shapes, the query keys' 400s naming them, 504 when requests still run, 404 where the
deployment did not turn sleep mode on, 401 without a key where keys are set, 403 from a foreign
web page."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest
from fastapi.testclient import TestClient

from helpers.http_front import front_app
from helpers.rpc import Answer, Refused
from helpers.threads import wait_until
from pdserve.protos.security import ClientKeys
from pdserve.router.admission import Admission
from pdserve.router.pause import RouterPause
from pdserve.router.sleep import RouterSleep, SleepError

KEY = "sk-sleep-0123456789abcdef"
ALL = ["weights", "kv_cache", "scheduling"]


class Method:
    """One RPC of a FakeStub, called directly or with .future, both recorded in its stub."""

    def __init__(self, stub, name: str):
        self.stub, self.name = stub, name

    def __call__(self, request, timeout=None):
        return self.future(request, timeout).result()

    def future(self, request, timeout=None):
        stub = self.stub
        tags = list(getattr(request, "tags", ()))
        stub.calls.append((self.name, request.level if self.name == "Sleep" else tags))
        error = stub.refuse.get(self.name)
        if error is not None:
            return Answer(error=error)
        if self.name == "Sleep":
            stub.level, stub.asleep = max(request.level, stub.level), {"weights", "kv_cache"}
        else:
            stub.asleep -= set(tags or ("weights", "kv_cache"))
            stub.level = stub.level if stub.asleep else 0
        return Answer(reply=object())


class FakeStub:
    """A worker's Sleep and WakeUp, keeping its engine's level and tags asleep; `refuse`: method
    name -> the RpcError it ends with."""

    def __init__(self):
        self.calls, self.refuse, self.level, self.asleep = [], {}, 0, set()
        self.Sleep, self.WakeUp = Method(self, "Sleep"), Method(self, "WakeUp")


class FakeWorker:
    def __init__(self, name: str, dead: str = ""):
        self.name, self.dead, self.stub = name, dead, FakeStub()


class FakePool:
    def __init__(self, workers):
        self.workers = list(workers)

    def members(self):
        return list(self.workers)

    def name(self, worker) -> str:
        return worker.name


def _cluster(n: int = 2, enabled: bool = True, dead=()):
    """(RouterSleep, its admission, its RouterPause, the workers, aborts asked for)."""
    workers = [FakeWorker(f"w{i}") for i in range(n)] + [FakeWorker(d, "stopped") for d in dead]
    admission = Admission(4, 4, 5.0)
    aborts: list = []
    pause = RouterPause(admission, lambda: aborts.append(1) or 0, enabled=True)
    return RouterSleep(FakePool(workers), pause, enabled), admission, pause, workers, aborts


def _drained() -> bool:
    return True


def test_sleep_holds_every_request_and_puts_every_worker_to_sleep():
    sleep, admission, pause, workers, aborts = _cluster(dead=("gone",))
    assert sleep.sleep(1, "abort", _drained) == 1
    assert admission.is_paused and aborts == [1]  # abort ended the running ones
    assert (sleep.level, sleep.asleep_tags, sleep.is_sleeping) == (1, tuple(ALL), True)
    assert [w.stub.calls for w in workers] == [[("Sleep", 1)], [("Sleep", 1)], []]  # not the dead
    pause.resume()  # a client's /resume cannot open the gate while the cluster sleeps
    assert admission.is_paused
    assert sleep.wake_up(None) is True
    assert [w.stub.calls[-1] for w in workers[:2]] == [("WakeUp", ["weights", "kv_cache"])] * 2
    assert not admission.is_paused and not sleep.is_sleeping and sleep.level == 0


def test_a_staged_wake_opens_the_gate_with_the_last_tag():
    sleep, admission, _, workers, _ = _cluster()
    sleep.sleep(2, "wait", _drained)
    assert sleep.wake_up(["weights"]) is False
    assert sleep.asleep_tags == ("kv_cache", "scheduling") and admission.is_paused
    assert sleep.wake_up(["scheduling"]) is False  # level 0's tag: memory still sleeps
    assert [w.stub.calls for w in workers] == [[("Sleep", 2), ("WakeUp", ["weights"])]] * 2
    assert sleep.wake_up(["kv_cache"]) is True  # scheduling wakes with the last of the memory
    assert not admission.is_paused and sleep.asleep_tags == ()
    assert workers[0].stub.calls[-1] == ("WakeUp", ["kv_cache"])


def test_a_client_pause_outlives_the_sleep():
    sleep, admission, pause, _, _ = _cluster()
    pause.pause("wait")
    sleep.sleep(1, "wait", _drained)
    sleep.wake_up(None)
    assert admission.is_paused  # the client's pause is its own: /resume opens it
    pause.resume()
    assert not admission.is_paused


@pytest.mark.parametrize(
    "code, status",
    [
        (grpc.StatusCode.FAILED_PRECONDITION, 409),
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.UNAVAILABLE, 503),
    ],
)
def test_a_worker_that_refuses_undoes_the_whole_sleep(code, status):
    sleep, admission, _, workers, _ = _cluster()
    workers[1].stub.refuse["Sleep"] = Refused(code, "a quantized engine cannot sleep at level 2")
    with pytest.raises(SleepError) as e:
        sleep.sleep(2, "wait", _drained)
    assert e.value.status == status
    assert "worker w1" in e.value.message and "a quantized engine" in e.value.message
    assert workers[0].stub.calls == [("Sleep", 2), ("WakeUp", [])]  # woken again
    assert workers[0].stub.level == 0
    assert not sleep.is_sleeping and not admission.is_paused


def test_a_worker_that_cannot_be_put_back_keeps_the_cluster_asleep_until_a_wake():
    sleep, admission, _, workers, _ = _cluster()
    workers[0].stub.refuse["WakeUp"] = Refused(grpc.StatusCode.UNAVAILABLE, "gone")
    workers[1].stub.refuse["Sleep"] = Refused(grpc.StatusCode.FAILED_PRECONDITION, "busy")
    with pytest.raises(SleepError) as e:
        sleep.sleep(1, "wait", _drained)
    assert e.value.status == 500 and "(w0)" in e.value.message
    # w0 sleeps: no request may reach it, and a wake wakes every worker
    assert sleep.is_sleeping and admission.is_paused
    workers[0].stub.refuse.clear()
    workers[1].stub.refuse.clear()
    assert sleep.wake_up(None) is True and not admission.is_paused
    assert workers[0].stub.level == 0


def test_a_deeper_sleep_is_taken_a_shallower_one_answers_the_state():
    sleep, _, _, workers, _ = _cluster()
    sleep.sleep(1, "wait", _drained)
    assert sleep.sleep(2, "wait", _drained) == 2
    assert sleep.sleep(1, "wait", _drained) == 2  # as deep already: no worker asked
    assert workers[0].stub.calls == [("Sleep", 1), ("Sleep", 2)]
    assert sleep.level == 2


def test_a_deeper_sleep_one_worker_refuses_leaves_the_cluster_at_its_level():
    sleep, admission, _, workers, _ = _cluster()
    sleep.sleep(1, "wait", _drained)
    workers[1].stub.refuse["Sleep"] = Refused(grpc.StatusCode.FAILED_PRECONDITION, "quantized")
    with pytest.raises(SleepError) as e:
        sleep.sleep(2, "wait", _drained)
    assert e.value.status == 409
    # the worker that went deeper is put back at level 1
    assert workers[0].stub.calls == [("Sleep", 1), ("Sleep", 2), ("WakeUp", []), ("Sleep", 1)]
    assert (sleep.level, sleep.asleep_tags) == (1, tuple(ALL)) and admission.is_paused


def test_a_worker_that_fails_to_wake_leaves_its_tags_asleep():
    sleep, admission, _, workers, _ = _cluster()
    sleep.sleep(1, "wait", _drained)
    workers[0].stub.refuse["WakeUp"] = Refused(grpc.StatusCode.FAILED_PRECONDITION, "shm full")
    with pytest.raises(SleepError) as e:
        sleep.wake_up(["kv_cache"])
    assert e.value.status == 409 and "worker w0" in e.value.message
    assert "shm full" in e.value.message and "kv_cache still asleep" in e.value.message
    assert sleep.asleep_tags == tuple(ALL) and admission.is_paused
    del workers[0].stub.refuse["WakeUp"]
    assert sleep.wake_up(None) is True and not admission.is_paused


def test_level_0_holds_the_requests_and_asks_no_worker():
    sleep, admission, _, workers, _ = _cluster()
    assert sleep.sleep(0, "wait", _drained) == 0
    assert sleep.is_sleeping and sleep.asleep_tags == ("scheduling",) and admission.is_paused
    assert sleep.wake_up(["weights"]) is True  # no memory sleeps: any wake resumes, as vLLM's
    assert not admission.is_paused and all(w.stub.calls == [] for w in workers)
    assert sleep.wake_up(None) is True  # awake already: nothing to do


def test_requests_that_still_run_are_a_504_and_nothing_changes():
    sleep, admission, _, workers, _ = _cluster()
    with pytest.raises(SleepError) as e:
        sleep.sleep(1, "wait", lambda: False)
    assert e.value.status == 504
    assert not admission.is_paused and not sleep.is_sleeping
    assert all(w.stub.calls == [] for w in workers)


def test_one_operation_at_a_time():
    sleep, _, _, _, _ = _cluster()
    inside, go = threading.Event(), threading.Event()

    def slow_drain() -> bool:
        inside.set()
        return go.wait(10)

    t = threading.Thread(target=sleep.sleep, args=(1, "wait", slow_drain))
    t.start()
    assert inside.wait(10)
    for call in (lambda: sleep.wake_up(None), lambda: sleep.sleep(2, "wait", _drained)):
        with pytest.raises(SleepError) as e:
            call()
        assert e.value.status == 409
    go.set()
    t.join(10)
    assert sleep.level == 1


def test_off_no_worker_and_bad_fields():
    sleep, _, _, _, _ = _cluster(enabled=False)
    with pytest.raises(SleepError) as e:
        sleep.sleep(1, "wait", _drained)
    assert e.value.status == 404 and "router.sleep_mode" in e.value.message
    sleep, admission, _, _, _ = _cluster(n=0, dead=("gone",))
    with pytest.raises(SleepError) as e:
        sleep.sleep(1, "wait", _drained)
    assert e.value.status == 503 and not admission.is_paused
    for bad in ("3", "-1", "one", "1.5"):
        with pytest.raises(SleepError) as e:
            RouterSleep.check_level(bad)
        assert (e.value.status, e.value.param) == (400, "level")
    with pytest.raises(SleepError) as e:
        RouterSleep.check_tags(["weights", "gpu"])
    assert e.value.param == "tags" and "'gpu'" in e.value.message
    assert RouterSleep.check_tags(["kv_cache", "weights", "kv_cache"]) == ["weights", "kv_cache"]


# ---- the HTTP endpoints -----------------------------------------------------------------------
def _client(sleep, pause, **settings) -> TestClient:
    return TestClient(front_app(sleep=sleep, pause=pause, **settings))


def test_http_sleep_and_staged_wake_in_vllms_shapes():
    sleep, admission, pause, workers, aborts = _cluster()
    with _client(sleep, pause) as client:
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        r = client.post("/sleep", params={"level": 2})
        assert (r.status_code, r.json()) == (200, {"status": "sleeping", "level": 2})
        assert aborts and admission.is_paused  # mode=abort (vLLM's default) ended what ran
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        r = client.post("/sleep", params={"level": 1})  # shallower: the state
        assert r.json() == {"status": "sleeping", "level": 2}
        r = client.post("/wake_up", params={"tags": "weights"})
        assert r.json() == {"status": "sleeping", "tags_woken": ["weights"]}
        r = client.post("/wake_up")
        assert r.json() == {"status": "awake", "tags_woken": None}
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        assert not admission.is_paused
        r = client.post("/sleep")  # level 1 by default
        assert r.json() == {"status": "sleeping", "level": 1}
        r = client.post("/wake_up?tags=weights&tags=kv_cache")
        assert r.json() == {"status": "awake", "tags_woken": ["weights", "kv_cache"]}
    assert workers[0].stub.calls[-2:] == [("Sleep", 1), ("WakeUp", ["weights", "kv_cache"])]


@pytest.mark.parametrize(
    "path, query, param",
    [
        ("/sleep", "level=3", "level"),
        ("/sleep", "level=deep", "level"),
        ("/sleep", "mode=keep", "mode"),
        ("/sleep", "mode=later", "mode"),
        ("/sleep", "timeout=0", "timeout"),
        ("/wake_up", "tags=weights&tags=gpu", "tags"),
    ],
)
def test_http_bad_query_values_are_400_naming_the_key(path, query, param):
    sleep, admission, pause, workers, _ = _cluster()
    with _client(sleep, pause) as client:
        r = client.post(f"{path}?{query}")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not sleep.is_sleeping and not admission.is_paused
    assert all(w.stub.calls == [] for w in workers)


def test_http_a_workers_refusal_names_it_and_a_long_wait_is_504():
    sleep, admission, pause, workers, _ = _cluster()
    workers[1].stub.refuse["Sleep"] = Refused(
        grpc.StatusCode.FAILED_PRECONDITION, "sleep levels 1-2 release memory on CPU engines only"
    )
    ticket = admission.enter()  # a request that runs on, and ends only after the answer
    assert ticket.granted
    with _client(sleep, pause) as client:
        r = client.post("/sleep?mode=wait&timeout=0.05")
        assert r.status_code == 504 and "still ran" in r.json()["error"]["message"], r.text
        admission.leave(ticket)
        r = client.post("/sleep?level=1")
        assert r.status_code == 409, r.text
        message = r.json()["error"]["message"]
    assert "worker w1" in message and "CPU engines only" in message
    assert not sleep.is_sleeping and not admission.is_paused


def test_http_off_is_404_and_keys_are_needed_where_set():
    sleep, _, pause, _, _ = _cluster(enabled=False)
    with _client(sleep, pause) as client:
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
            assert client.request(method, path).status_code == 404
    with _client(None, pause) as client:
        assert client.get("/is_sleeping").status_code == 404
    sleep, _, pause, workers, _ = _cluster()
    with _client(sleep, pause, keys=ClientKeys((KEY,))) as client:
        assert client.post("/sleep").status_code == 401
        # a web page of a foreign origin cannot put the cluster to sleep (router/openai/origins.py)
        foreign = {"authorization": f"Bearer {KEY}", "origin": "http://evil.example"}
        assert client.post("/sleep", headers=foreign).status_code == 403
        assert not sleep.is_sleeping
        assert client.get("/is_sleeping").status_code == 401
        r = client.post("/sleep", headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 200
    assert workers[0].stub.calls == [("Sleep", 1)]


class ReportingPool(FakePool):
    """A FakePool whose workers' reports reach its listeners (WorkerPool.on_report)."""

    def __init__(self, workers):
        super().__init__(workers)
        self.listeners: list = []

    def on_report(self, listener) -> None:
        self.listeners.append(listener)

    def is_member(self, worker) -> bool:
        return worker in self.workers

    def report(self, worker, sleep_level: int) -> None:
        for listener in self.listeners:
            listener(worker, SimpleNamespace(sleep_level=sleep_level))


def test_a_worker_that_joins_a_sleeping_cluster_is_put_to_sleep():
    """A restarted or new worker would hold the memory the sleep gave back; in a partly woken
    cluster no single Sleep matches, so it is left awake there."""
    workers = [FakeWorker("w0")]
    pool = ReportingPool(workers)
    admission = Admission(4, 4, 5.0)
    sleep = RouterSleep(pool, RouterPause(admission, lambda: 0, enabled=True), enabled=True)
    late = FakeWorker("late")
    pool.report(late, 0)  # awake cluster: nothing to do
    sleep.sleep(2, "wait", _drained)
    pool.workers.append(late)
    pool.report(late, 0)
    wait_until(lambda: late.stub.calls == [("Sleep", 2)], 5.0, "the late worker's Sleep")
    pool.report(workers[0], 2)  # asleep as the cluster: left alone
    assert workers[0].stub.calls == [("Sleep", 2)]
    assert sleep.catch_ups == 1
    sleep.wake_up(["weights"])
    other = FakeWorker("other")
    pool.workers.append(other)
    pool.report(other, 0)  # partly woken: no Sleep gives its mix
    time.sleep(0.2)
    assert other.stub.calls == []
    assert sleep.wake_up(None) is True
    assert late.stub.calls[-1] == ("WakeUp", ["kv_cache"])  # woken with the others
