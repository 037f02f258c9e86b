"""A worker's sleep mode (worker_common/sleep.py) with a fake engine and no sockets: Sleep and
WakeUp check every field before the engine is asked (a level of 1 or 2, tags of "weights" and
"kv_cache", at most four: else INVALID_ARGUMENT), run the engine's call on its loop with the
Stats saying a long turn is under way, answer what still sleeps, and turn the engine's refusals
into FAILED_PRECONDITION (its state) or INVALID_ARGUMENT, and a call past its bound into
DEADLINE_EXCEEDED; a request the sleeping engine refuses (EngineAsleep) is UNAVAILABLE; WorkerStats
carry the level and the tags asleep; both worker services and their wire definitions have the two
calls; `pdserve up --enable-sleep-mode` turns router.sleep_mode on."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest

from helpers.up import flags_config
from pdserve.decode_worker.service import DecodeWorkerServicer
from pdserve.engine.errors import EngineAsleep, SleepRefused
from pdserve.prefill_worker.service import PrefillWorkerServicer
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.worker_common import sleep as worker_sleep
from pdserve.worker_common.errors import engine_error_status


class FakeEngine:
    """LLMEngine's sleep API: levels 1-2, tags woken apart; `refuse` makes both calls raise it."""

    def __init__(self, refuse: Exception | None = None):
        self.sleep_level, self._asleep, self.refuse, self.calls = 0, set(), refuse, []
        self.loop = None

    @property
    def asleep_tags(self) -> tuple[str, ...]:
        return tuple(t for t in ("weights", "kv_cache") if t in self._asleep)

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level, self.loop.loading_weights))
        if self.refuse is not None:
            raise self.refuse
        self.sleep_level, self._asleep = max(level, self.sleep_level), {"weights", "kv_cache"}

    def wake_up(self, tags) -> None:
        self.calls.append(("wake_up", tags, self.loop.loading_weights))
        if self.refuse is not None:
            raise self.refuse
        self._asleep -= set(tags or ("weights", "kv_cache"))
        if not self._asleep:
            self.sleep_level = 0


class FakeLoop:
    """EngineLoop.call runs the function here; `timeout` makes it time out instead."""

    def __init__(self, engine, timeout: bool = False):
        self.engine, self.loading_weights, self.timeout, self.timeouts = engine, False, timeout, []
        engine.loop = self

    def call(self, fn, *args, timeout=None):
        self.timeouts.append(timeout)
        if self.timeout:
            raise concurrent.futures.TimeoutError()
        return fn(*args)


class Aborted(Exception):
    pass


class FakeContext:
    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


def _call(method, loop, request) -> tuple[object, FakeContext]:
    context = FakeContext()
    try:
        return method(loop, request, context), context
    except Aborted:
        return None, context


def test_sleep_then_staged_wake_answers_what_still_sleeps():
    engine = FakeEngine()
    loop = FakeLoop(engine)
    reply, _ = _call(worker_sleep.sleep, loop, worker_pb2.SleepRequest(level=2))
    assert (reply.level, list(reply.asleep_tags)) == (2, ["weights", "kv_cache"])
    reply, _ = _call(worker_sleep.wake_up, loop, worker_pb2.WakeUpRequest(tags=["weights"]))
    assert (reply.level, list(reply.asleep_tags)) == (2, ["kv_cache"])
    reply, _ = _call(worker_sleep.wake_up, loop, worker_pb2.WakeUpRequest())  # none: every tag
    assert (reply.level, list(reply.asleep_tags)) == (0, [])
    # each ran on the loop with the Stats saying a long turn is under way, and no longer after
    assert engine.calls == [
        ("sleep", 2, True),
        ("wake_up", ["weights"], True),
        ("wake_up", None, True),
    ]
    assert loop.loading_weights is False
    assert loop.timeouts == [worker_sleep.SLEEP_TIMEOUT_S] * 3


@pytest.mark.parametrize(
    "method, request_, word",
    [
        (worker_sleep.sleep, worker_pb2.SleepRequest(level=0), "level"),
        (worker_sleep.sleep, worker_pb2.SleepRequest(level=3), "level"),
        (worker_sleep.wake_up, worker_pb2.WakeUpRequest(tags=["scheduling"]), "'scheduling'"),
        (worker_sleep.wake_up, worker_pb2.WakeUpRequest(tags=["weights", "bogus"]), "'bogus'"),
        (worker_sleep.wake_up, worker_pb2.WakeUpRequest(tags=["weights"] * 5), "at most 4"),
    ],
)
def test_fields_out_of_bounds_are_invalid_before_the_engine_is_asked(method, request_, word):
    engine = FakeEngine()
    reply, context = _call(method, FakeLoop(engine), request_)
    assert reply is None and context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert word in context.details
    assert engine.calls == []


@pytest.mark.parametrize(
    "precondition, code",
    [(True, grpc.StatusCode.FAILED_PRECONDITION), (False, grpc.StatusCode.INVALID_ARGUMENT)],
)
def test_the_engines_refusal_is_the_status_that_says_why(precondition, code):
    refusal = SleepRefused("requests still run on this engine", precondition)
    loop = FakeLoop(FakeEngine(refuse=refusal))
    for method, request_ in (
        (worker_sleep.sleep, worker_pb2.SleepRequest(level=1)),
        (worker_sleep.wake_up, worker_pb2.WakeUpRequest(tags=["kv_cache"])),
    ):
        reply, context = _call(method, loop, request_)
        assert reply is None and context.code == code
        assert context.details == "requests still run on this engine"
        assert loop.loading_weights is False


def test_a_call_past_its_bound_is_deadline_exceeded():
    reply, context = _call(
        worker_sleep.wake_up, FakeLoop(FakeEngine(), timeout=True), worker_pb2.WakeUpRequest()
    )
    assert reply is None and context.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "wake up" in context.details


def test_a_request_the_sleeping_engine_refuses_is_unavailable():
    code, message = engine_error_status(EngineAsleep("the engine sleeps (weights asleep)"))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "the worker sleeps" in message and "weights asleep" in message


def test_stats_carry_the_level_and_the_tags_asleep():
    engine = FakeEngine()
    FakeLoop(engine)
    engine.sleep(1)
    engine.wake_up(["weights"])
    stats = worker_pb2.WorkerStats(**worker_sleep.stats(engine))
    assert (stats.sleep_level, list(stats.asleep_tags)) == (1, ["kv_cache"])
    # an engine without sleep mode is awake
    assert worker_sleep.stats(object()) == {"sleep_level": 0, "asleep_tags": []}
    fields = worker_pb2.WorkerStats.DESCRIPTOR.fields_by_name
    assert (fields["sleep_level"].number, fields["asleep_tags"].number) == (640, 641)


def test_both_services_serve_sleep_and_wake_up():
    for service, servicer, base in (
        ("DecodeWorker", DecodeWorkerServicer, worker_pb2_grpc.DecodeWorkerServicer),
        ("PrefillWorker", PrefillWorkerServicer, worker_pb2_grpc.PrefillWorkerServicer),
    ):
        methods = worker_pb2.DESCRIPTOR.services_by_name[service].methods_by_name
        assert methods["Sleep"].input_type.name == "SleepRequest"
        assert methods["Sleep"].output_type.name == "SleepStatus"
        assert methods["WakeUp"].input_type.name == "WakeUpRequest"
        assert methods["WakeUp"].output_type.name == "SleepStatus"
        assert servicer.Sleep is not base.Sleep and servicer.WakeUp is not base.WakeUp


def test_the_vllm_flag_turns_sleep_mode_on(tmp_path):
    yaml = {"model": "m", "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}}
    assert flags_config(tmp_path, yaml, "--enable-sleep-mode").router.sleep_mode is True
    assert flags_config(tmp_path, yaml).router.sleep_mode is False
