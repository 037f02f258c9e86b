"""The HTTP front's weight-update endpoints, SGLang's names and shapes (the RL frameworks built on
it call them), on router/weights.py:

    POST /update_weights_from_disk   {"model_path": "/ckpt/step-40", "weight_version": "40",
                                      "abort_all_requests": false, "keep_pause": false}
                                     -> {"success": true, "message": "...",
                                         "num_paused_requests": 0}
    GET  /get_weight_version         {"weight_version": "40"} (null before the first update)
    GET  /weight_info                the same, vLLM's name, with "ranks" and "groups"
    POST /init_weights_update_group, /update_weights_from_distributed,
         /destroy_weights_update_group   a trainer's weight group (router/weights.py,
                                     engine/weight_sync.py): its tensors sent straight to every
                                     rank; an update pauses as a disk update does

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

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
DEFAULT_GROUP_TIMEOUT_S = 600.0

router = APIRouter()
_RUNNING: set = set()  # the updates under way (kept referenced until they end)
_BOOLS = ("abort_all_requests", "keep_pause", "flush_cache", "torch_empty_cache", "is_async")
_IGNORED = ("recapture_cuda_graph", "token_step")
_KNOWN = {"model_path", "weight_version", "load_format", *_BOOLS, *_IGNORED}


def _outcome(
    status: int, success: bool, message: str, paused: int = 0, reinit: bool = False
) -> JSONResponse:
    body = {"success": success, "message": message, "num_paused_requests": paused}
    if reinit:  # a weight group's update: init the group again, then update (WeightSender does)
        body["reinit_group"] = True
    return JSONResponse(body, status_code=status)


async def _body(request: Request, known: set = _KNOWN) -> dict:
    raw = await state_of(request).read_body(request)
    try:
        body = json.loads(raw)
    except ValueError:
        raise WeightsError(400, "the body is not JSON") from None
    except RecursionError:  # nested past Python's limit: no field of this body is
        raise WeightsError(400, "the body is nested too deeply: send its fields flat") from None
    if not isinstance(body, dict):
        raise WeightsError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - known)
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
    task = asyncio.create_task(_apply(pause, mode, keep, weights, weights.update, path, version))
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    return await asyncio.shield(task)


async def _apply(pause, mode: str, keep: bool, weights, update, *args) -> JSONResponse:
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
        message = await asyncio.to_thread(update, *args)
    except WeightsError as e:
        if e.status != 500:
            pause.release(keep)
        elif weights.held_apart:  # one hold for "the pools are apart" is enough
            pause.release()
        else:  # the pools serve different weights: this hold stays until an update succeeds
            weights.held_apart = True
        return _outcome(e.status, False, e.message, aborted, e.reinit)
    except BaseException:  # a fault of ours: the hold must not outlive it
        pause.release(keep)
        raise
    pause.release(keep)
    if weights.held_apart:
        weights.held_apart = False
        pause.release()
    return _outcome(200, True, message, aborted)


async def _version(request: Request, more: bool = False) -> dict:
    front = state_of(request)
    front.authorize(request)
    weights = front.settings.weights
    out = {"weight_version": (weights.version if weights is not None else "") or None}
    if more:  # what a trainer's group would hold besides the trainer, and the groups open
        out["ranks"] = weights.ranks() if weights is not None else 0
        out["groups"] = sorted(weights.groups) if weights is not None else []
    return out


@router.get("/get_weight_version")
async def get_weight_version(request: Request):
    return await _version(request)


@router.get("/weight_info")
async def weight_info(request: Request):
    return await _version(request, more=True)


# ---- a trainer's weight group (router/weights.py, engine/weight_sync.py) ------------------------
_GROUP_KNOWN = {
    "master_address",
    "master_port",
    "rank_offset",
    "world_size",
    "group_name",
    "backend",
    "timeout_s",
}
_UPDATE_KNOWN = {
    "transfer_id",
    "names",
    "dtypes",
    "shapes",
    "group_name",
    "weight_version",
    "load_format",
    *_BOOLS,
    *_IGNORED,
}


def _int(body: dict, name: str, default=None) -> int:
    value = body.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise WeightsError(400, f"{name} must be a whole number")
    return value


def _str(body: dict, name: str, default=None) -> str:
    value = body.get(name, default)
    if not isinstance(value, str):
        raise WeightsError(400, f"{name} must be a string")
    return value


async def _fields(request: Request, known: set) -> dict:
    body = await _body(request, known)
    name = _str(body, "group_name", DEFAULT_GROUP)
    return {"group_name": name, **body}


def _enabled(front):
    weights = front.settings.weights
    if weights is None or not weights.enabled:
        raise ApiError(
            404,
            "weight updates are off here: the deployment needs router.weight_updates",
            code="not_found",
        )
    return weights


async def _group_call(request: Request, known: set, run) -> JSONResponse:
    """A weight group's init or destroy: authorized, enabled, its body read, then `run(body)`'s
    message on a thread (it calls every worker); SGLang's outcome shape either way."""
    front = state_of(request)
    front.authorize(request)
    weights = _enabled(front)
    try:
        body = await _fields(request, known)
        message = await asyncio.to_thread(run, weights, body)
    except WeightsError as e:
        return _outcome(e.status, False, e.message)
    return _outcome(200, True, message)


def _init(weights, body: dict) -> str:
    backend = _str(body, "backend", "gloo")
    if backend != "gloo":
        raise WeightsError(
            400,
            f"backend {backend[:20]!r}: pdserve's weight groups run on gloo (NCCL is not "
            "built yet); open the trainer's end with pdserve.engine.weight_sync",
        )
    timeout_s = body.get("timeout_s", DEFAULT_GROUP_TIMEOUT_S)
    if not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool):
        raise WeightsError(400, "timeout_s must be a number of seconds")
    return weights.init_group(
        {
            "group_name": body["group_name"],
            "master_address": _str(body, "master_address"),
            "master_port": _int(body, "master_port"),
            "rank_offset": _int(body, "rank_offset", 1),
            "world_size": _int(body, "world_size"),
            "timeout_s": float(timeout_s),
        }
    )


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request):
    return await _group_call(request, _GROUP_KNOWN, _init)


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request):
    front = state_of(request)
    front.authorize(request)
    weights, pause = _enabled(front), front.settings.pause
    try:
        body = await _fields(request, _UPDATE_KNOWN)
        lists = {}
        for name in ("names", "dtypes", "shapes"):
            if not isinstance(body.get(name), list):
                raise WeightsError(400, f"{name} must be a list")
            lists[name] = body[name]
        # SGLang's trainers may spell a dtype as torch prints it
        dtypes = [d.removeprefix("torch.") if isinstance(d, str) else d for d in lists["dtypes"]]
        version = body.get("weight_version")
        fields = {
            "group_name": body["group_name"],
            "names": lists["names"],
            "dtypes": dtypes,
            "shapes": lists["shapes"],
            "weight_version": "" if version is None else version,
            "transfer_id": body.get("transfer_id"),
        }
        if not isinstance(fields["weight_version"], str):
            raise WeightsError(400, "weight_version must be a string")
        weights.check_group_update(fields)
    except WeightsError as e:
        return _outcome(e.status, False, e.message)
    mode = "abort" if body.get("abort_all_requests") else "wait"
    task = asyncio.create_task(
        _apply(
            pause, mode, bool(body.get("keep_pause")), weights, weights.update_from_group, fields
        )
    )
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    return await asyncio.shield(task)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request):
    return await _group_call(
        request, {"group_name"}, lambda weights, body: weights.destroy_group(body["group_name"])
    )
