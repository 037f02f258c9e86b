"""The HTTP front's sleep-mode endpoints, vLLM's names and shapes (its dev-mode server's, with
--enable-sleep-mode), on router/sleep.py:

    POST /sleep       ?level=0|1|2 (1), ?mode=abort|wait (abort), ?timeout=<s> (600): every new
                      request is held at the router; once none runs, every worker sleeps
                      -> {"status": "sleeping", "level": n}
    POST /wake_up     ?tags=weights&tags=kv_cache&tags=scheduling (repeatable; none: every tag)
                      -> {"status": "awake" | "sleeping", "tags_woken": [...] | null}
    GET  /is_sleeping {"is_sleeping": bool}

The query keys are checked as /pause checks its own (router/openai/pause.py: mode=keep and an
unknown mode or tag are 400s naming their key), and a sleep whose running requests have not ended
within `timeout` is a 504 that leaves everything as it was. A worker that refuses is the status
router/sleep.py gives (409 its state, 400, 503), with the worker's name and its engine's reason.
Each needs a client key where the router has keys, and is 404 unless the deployment sets
router.sleep_mode. The worker calls block, so each sleep or wake runs on a thread, in a task of
its own that a client leaving mid-call does not cancel; the wait for the running requests is
/pause's `drain`, on the event loop.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.pause import drain
from pdserve.router.openai.state import state_of
from pdserve.router.pause import DEFAULT_TIMEOUT_S, PauseError, RouterPause
from pdserve.router.sleep import SleepError

router = APIRouter()
_RUNNING: set = set()  # the sleeps and wakes under way (kept referenced until they end)


def _sleep_of(request: Request):
    front = state_of(request)
    front.authorize(request)  # the key first: a stranger learns nothing
    control = front.settings.sleep
    if control is None:
        raise ApiError(404, "sleep mode is off here", code="not_found")
    try:
        control.check_enabled()
    except SleepError as e:
        raise _api_error(e) from None
    return control


def _api_error(e: SleepError | PauseError) -> ApiError:
    return ApiError.of_status(e.status, e.message, e.param)


async def _in_task(fn, *args):
    """`fn(*args)` on a thread, in a task a client that leaves cannot cancel."""
    task = asyncio.create_task(asyncio.to_thread(fn, *args))
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    try:
        return await asyncio.shield(task)
    except (SleepError, PauseError) as e:
        raise _api_error(e) from None


@router.post("/sleep")
async def sleep(request: Request):
    control = _sleep_of(request)
    query = request.query_params
    try:
        level = control.check_level(query.get("level", "1"))
        mode = RouterPause.check_mode(query.get("mode", "abort"))
        timeout = RouterPause.check_timeout(query.get("timeout", DEFAULT_TIMEOUT_S))
    except (SleepError, PauseError) as e:
        raise _api_error(e) from None
    loop = asyncio.get_running_loop()

    def drained() -> bool:  # on the sleep's thread: /pause's wait, on the event loop
        done = asyncio.run_coroutine_threadsafe(drain(control.pause, mode, timeout), loop)
        return done.result()[0]

    level = await _in_task(control.sleep, level, mode, drained)
    return {"status": "sleeping", "level": level}


@router.post("/wake_up")
async def wake_up(request: Request):
    control = _sleep_of(request)
    tags = request.query_params.getlist("tags") or None  # none: every tag, as vLLM's
    try:
        control.check_tags(tags)
    except SleepError as e:
        raise _api_error(e) from None
    awake = await _in_task(control.wake_up, tags)
    return {"status": "awake" if awake else "sleeping", "tags_woken": tags}


@router.get("/is_sleeping")
async def is_sleeping(request: Request):
    return {"is_sleeping": _sleep_of(request).is_sleeping}
