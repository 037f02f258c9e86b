"""A worker's sleep mode, for both worker services: Sleep and WakeUp (the router's /sleep and
/wake_up, router/sleep.py, called on every worker at once while the router holds every request
back) put the engine to sleep at a level and wake some or all of its tags, through the engine
(LLMEngine.sleep and wake_up: engine/sleep.py says what each level frees), on the engine's loop
thread between steps; the gRPC handler thread waits for it, bounded by SLEEP_TIMEOUT_S. The
fields are checked before the engine is asked (a level of 1 or 2, tags of "weights" and
"kv_cache", at most MAX_SLEEP_TAGS of them: else INVALID_ARGUMENT); the engine refuses a state
that cannot sleep or wake now (FAILED_PRECONDITION: requests still run, a CUDA engine, a
quantized one at level 2, weights a level-2 sleep dropped that cannot be loaded again). While
the call runs, the loop says so in the worker's Stats (engine_loading_weights, as a weight update
does: a wake after level 2 loads the weights again), so the router does not take the long turn
for a hung engine. While the engine sleeps it refuses new work (EngineAsleep: UNAVAILABLE,
worker_common/errors.py). `stats` gives WorkerStats the level and the tags still asleep; each
call answers them too.
"""

from __future__ import annotations

import concurrent.futures

import grpc

from pdserve.engine.errors import SleepRefused
from pdserve.protos.limits import SLEEP_TIMEOUT_S, check_sleep_level, check_wake_tags
from pdserve.protos.pdserve.v1 import worker_pb2


def sleep(loop, request, context) -> worker_pb2.SleepStatus:
    why = check_sleep_level(request.level)
    if why is not None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
    _run(
        loop, lambda engine: engine.sleep(request.level), f"sleep at level {request.level}", context
    )
    return status(loop.engine)


def wake_up(loop, request, context) -> worker_pb2.SleepStatus:
    tags = list(request.tags)
    why = check_wake_tags(tags)
    if why is not None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
    wanted = tags or None  # none named: every tag, as vLLM's wake_up(None)
    _run(loop, lambda engine: engine.wake_up(wanted), "wake up", context)
    return status(loop.engine)


def _run(loop, fn, what: str, context) -> None:
    """Runs `fn(engine)` on the loop thread with the worker's Stats saying a long turn is under
    way, and turns the engine's refusal into the gRPC status that says why."""

    def run(engine):
        loop.loading_weights = True
        try:
            fn(engine)
        finally:
            loop.loading_weights = False

    try:
        loop.call(run, loop.engine, timeout=SLEEP_TIMEOUT_S)
    except SleepRefused as e:
        code = (
            grpc.StatusCode.FAILED_PRECONDITION
            if e.precondition
            else grpc.StatusCode.INVALID_ARGUMENT
        )
        context.abort(code, str(e))
    except concurrent.futures.TimeoutError:
        context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the engine did not {what} within {SLEEP_TIMEOUT_S:g} s",
        )


def status(engine) -> worker_pb2.SleepStatus:
    """What sleeps of the engine now."""
    fields = stats(engine)
    return worker_pb2.SleepStatus(level=fields["sleep_level"], asleep_tags=fields["asleep_tags"])


def stats(engine) -> dict:
    """The WorkerStats fields of the engine's sleep, read from any thread (an engine without
    sleep mode is awake)."""
    return {
        "sleep_level": getattr(engine, "sleep_level", 0),
        "asleep_tags": list(getattr(engine, "asleep_tags", ())),
    }
