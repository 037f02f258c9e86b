"""The HTTP front's weight-update endpoints, SGLang's names and shapes (the RL frameworks built on
it call them), on router/weights.py:

    POST /update_weights_from_disk   {"model_path": "/ckpt/step-40", "weight_version": "40",
                                      "abort_all_requests": false, "keep_pause": false}
                                     -> {"success": true, "message": "...",
                                         "num_paused_requests": 0}
    GET  /get_weight_version         {"weight_version": "40"} (null before the first update)
    GET  /weight_info                the same, vLLM's name

An update holds every new request at the router (router/pause.py `hold`), lets the running ones
finish (or, with abort_all_requests, ends them: finish_reason "abort"), waits until none runs (at
most router/pause.py's DEFAULT_TIMEOUT_S: then 504 and nothing changed), has every worker of both
pools load the checkpoint, and lets go of its hold: the router serves again unless a client's
/pause or another update still holds it, or keep_pause turned this hold into a client's (then
/resume). After a 500 its hold stays until an update succeeds.
Its outcome is SGLang's shape: 200 with success true, or success false with the status that says
why: 400 (a field, or a checkpoint a worker refused: every worker serves what it did before),
409 (another update runs, or a worker that cannot take one: a quantized mode, a draft model),
503, 504, or 500 when the pools were left serving different weights (the router then stays
paused). flush_cache is accepted as true only (the KV of old weights is always dropped);
load_format as null or "auto"; SGLang's CUDA-only keys (torch_empty_cache,
recapture_cuda_graph, token_step, is_async) are accepted and change nothing here. Needs a client
key where keys are set, and router.weight_updates (else 404).
"""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.pause import drain
from pdserve.router.openai.state import state_of
from pdserve.router.pause import DEFAULT_TIMEOUT_S
from pdserve.router.weights import WeightsError

router = APIRouter()
_RUNNING: set = set()  # the updates under way (kept referenced until they end)
_BOOLS = ("abort_all_requests", "keep_pause", "flush_cache", "torch_empty_cache", "is_async")
_IGNORED = ("recapture_cuda_graph", "token_step")
_KNOWN = {"model_path", "weight_version", "load_format", *_BOOLS, *_IGNORED}


def _outcome(status: int, success: bool, message: str, paused: int = 0) -> JSONResponse:
    body = {"success": success, "message": message, "num_paused_requests": paused}
    return JSONResponse(body, status_code=status)


async def _body(request: Request) -> dict:
    raw = await state_of(request).read_body(request)
    try:
        body = json.loads(raw)
    except ValueError:
        raise WeightsError(400, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise WeightsError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise WeightsError(400, f"unknown field(s) {', '.join(unknown)[:200]}")
    for name in _BOOLS:
        if name in body and not isinstance(body[name], bool):
            raise WeightsError(400, f"{name} must be true or false")
    if body.get("flush_cache") is False:
        raise WeightsError(
            400, "flush_cache=false would serve KV computed under the old weights: leave it out"
        )
    if body.get("load_format") not in (None, "auto"):
        raise WeightsError(400, 'load_format must be null or "auto" (the checkpoint\'s own)')
    return body


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request):
    front = state_of(request)
    front.authorize(request)
    weights, pause = front.settings.weights, front.settings.pause
    if weights is None or not weights.enabled:
        raise ApiError(
            404,
            "weight updates are off here: the deployment needs router.weight_updates",
            code="not_found",
        )
    try:
        body = await _body(request)
        path, version = weights.check(body.get("model_path"), body.get("weight_version"))
    except WeightsError as e:
        return _outcome(e.status, False, e.message)
    mode = "abort" if body.get("abort_all_requests") else "wait"
    keep = bool(body.get("keep_pause"))
    # its own task: a client that leaves mid-update cancels this handler, never the update, which
    # then still lets go of its hold when it ends
    task = asyncio.create_task(_apply(pause, weights, mode, keep, path, version))
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    return await asyncio.shield(task)


async def _apply(pause, weights, mode: str, keep: bool, path: str, version: str) -> JSONResponse:
    """The update from its pause hold to its release (the module's docstring)."""
    aborted = pause.hold(mode)
    drained, stragglers = await drain(pause, mode, DEFAULT_TIMEOUT_S)
    aborted += stragglers
    if not drained:
        pause.release()
        return _outcome(
            504,
            False,
            f"{pause.running()} request(s) still ran after {DEFAULT_TIMEOUT_S:g} s; nothing "
            "changed (abort_all_requests: true ends them)",
            aborted,
        )
    try:
        message = await asyncio.to_thread(weights.update, path, version)
    except WeightsError as e:
        if e.status != 500:
            pause.release(keep)
        elif weights.held_apart:  # one hold for "the pools are apart" is enough
            pause.release()
        else:  # the pools serve different weights: this hold stays until an update succeeds
            weights.held_apart = True
        return _outcome(e.status, False, e.message, aborted)
    except BaseException:  # a fault of ours: the hold must not outlive it
        pause.release(keep)
        raise
    pause.release(keep)
    if weights.held_apart:
        weights.held_apart = False
        pause.release()
    return _outcome(200, True, message, aborted)


async def _version(request: Request) -> dict:
    front = state_of(request)
    front.authorize(request)
    weights = front.settings.weights
    version = weights.version if weights is not None else ""
    return {"weight_version": version or None}


@router.get("/get_weight_version")
async def get_weight_version(request: Request):
    return await _version(request)


@router.get("/weight_info")
async def weight_info(request: Request):
    return await _version(request)
