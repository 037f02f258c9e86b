"""The HTTP front's pause endpoints, vLLM's (its RL server's) names and shapes:

    POST /pause       ?mode=abort|wait (abort), ?timeout=<s> (600): every new request is held at
                      the router; abort ends the running ones now, wait lets them finish; the
                      answer {"status": "paused", "aborted": n} comes once none runs
    POST /resume      {"status": "resumed"}: the held requests run
    GET  /is_paused   {"is_paused": bool}

vLLM's older query keys are taken as it takes them: wait_for_inflight_requests=true is
mode=wait; clear_cache is accepted and changes nothing (a pause changes no weight, so every
worker's prefix cache stays valid). A pause whose running requests have not ended within
`timeout` answers 504 and stays paused (/resume, or /pause?mode=abort, from there). Each needs a
client key where the router has keys, and is 404 unless the deployment sets
router.pause_endpoints; what it does, and why at the router, is router/pause.py's. The wait runs
on the event loop (a 20 ms poll of the admission's count), holding no thread.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request

from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.state import state_of
from pdserve.router.pause import DEFAULT_TIMEOUT_S, PauseError, RouterPause

router = APIRouter()
POLL_S = 0.02
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _pause_of(request: Request) -> RouterPause:
    front = state_of(request)
    front.authorize(request)  # the key first: a stranger learns nothing
    pause = front.settings.pause
    if pause is None:
        raise ApiError(404, "pausing is off here", code="not_found")
    try:
        pause.check_enabled()
    except PauseError as e:
        raise _api_error(e) from None
    return pause


def _api_error(e: PauseError) -> ApiError:
    return ApiError.of_status(e.status, e.message, e.param)


def query_flag(request: Request, name: str) -> bool | None:
    """A true/false query key (None when absent), or a 400 naming it; the cache reset's
    (router/openai/cache.py) too."""
    raw = request.query_params.get(name)
    if raw is None:
        return None
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ApiError(400, f"{name} must be true or false; got {raw[:40]!r}", param=name)


@router.post("/pause")
async def pause(request: Request):
    control = _pause_of(request)
    query_flag(request, "clear_cache")  # checked, then nothing to do (the module's docstring)
    mode = request.query_params.get("mode")
    if mode is None:
        mode = "wait" if query_flag(request, "wait_for_inflight_requests") else "abort"
    try:
        mode = control.check_mode(mode)
        timeout = control.check_timeout(request.query_params.get("timeout", DEFAULT_TIMEOUT_S))
    except PauseError as e:
        raise _api_error(e) from None
    aborted = control.pause(mode)
    drained, stragglers = await drain(control, mode, timeout)
    if not drained:
        raise ApiError(
            504,
            f"paused, but {control.running()} request(s) still run after {timeout:g} s; "
            "the pause stays: POST /resume, or POST /pause?mode=abort to end them",
            "server_error",
        )
    return {"status": "paused", "aborted": aborted + stragglers}


async def drain(control: RouterPause, mode: str, timeout: float) -> tuple[bool, int]:
    """Polls, holding no thread, until no admitted call runs, ending under "abort" the calls
    admitted just before the gate closed: (whether none runs within `timeout`, how many of
    those it ended). /pause's and a weight update's (router/openai/weights.py)."""
    stragglers, until = 0, time.monotonic() + timeout
    while True:
        if mode == "abort":
            stragglers += control.abort_stragglers()
        if control.idle():
            return True, stragglers
        if time.monotonic() >= until:
            return False, stragglers
        await asyncio.sleep(POLL_S)


@router.post("/resume")
async def resume(request: Request):
    _pause_of(request).resume()
    return {"status": "resumed"}


@router.get("/is_paused")
async def is_paused(request: Request):
    return {"is_paused": _pause_of(request).is_paused}
