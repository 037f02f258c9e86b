"""The HTTP front's endpoints that say what is served:

    GET  /version             {"version"}: pdserve's (no key needed, as vLLM's)
    GET  /v1/models           the served model and its LoRA adapters (the router's gRPC
                              ListModels; vLLM's cards: an adapter's has `parent`, the base
                              model's id; `root` and `permission` as model_card says)
    GET  /v1/models/{id}      that model's card; 404 (model_not_found) for another id
    POST /v1/load_lora_adapter    {lora_name, lora_path}: every worker loads the adapter
    POST /v1/unload_lora_adapter  {lora_name}: every worker forgets it

The two LoRA endpoints (vLLM's) need a client key where the router has keys, and are 404 unless
the deployment sets lora.enabled and lora.allow_runtime_updates; router/lora.py tells the
workers, off the event loop. They answer vLLM's plain-text success line, or an OpenAI error
object naming the field at fault (400), the adapter not loaded (404, unload), or a worker that
did not take the change (409 or 503).

The models come from the router's own gRPC API, with the client's key, so a caller whose key
the router refuses gets the same 401 as on gRPC. The routes are declared on `router`, which
build_app (router/openai/app.py) includes; they keep no state of their own.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from pdserve import __version__
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.lora import AdapterCallError
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.state import state_of

router = APIRouter()


def model_card(m, created: int) -> dict:
    """vLLM's ModelCard of the router's card `m`: `root` the model's path or Hub repo id as the
    deployment names it (an adapter's: its path), which clients read to find the tokenizer when
    the served id is an alias; the id where the router's card has no root. `permission` is
    vLLM's one default ModelPermission, for clients that read it (nothing here enforces it)."""
    return {
        "id": m.id,
        "object": "model",
        "created": created,
        "owned_by": "pdserve",
        "root": m.root or m.id,
        "parent": m.parent or None,
        "max_model_len": m.max_model_len,
        "permission": [_permission(created)],
    }


def _permission(created: int) -> dict:
    """vLLM's ModelPermission with its defaults, as vLLM lists it on every card."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


async def served(request: Request) -> list:
    """The router's models (gRPC ListModels), for a caller whose key checks out."""
    front = state_of(request)
    metadata = front.authorize(request)
    try:
        reply = await front.stub.ListModels(
            pdserve_pb2.ListModelsRequest(), metadata=metadata, timeout=30
        )
    except grpc.RpcError as e:
        raise ApiError.from_grpc(e) from None
    return list(reply.models)


@router.get("/version")
async def version():
    return {"version": __version__}


@router.get("/v1/models")
async def models(request: Request):
    created = int(time.time())
    return {"object": "list", "data": [model_card(m, created) for m in await served(request)]}


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str):
    for m in await served(request):
        if m.id == model_id:
            return model_card(m, int(time.time()))
    raise ApiError(
        404,
        f"the model {model_id[:200]!r} does not exist here (GET /v1/models lists them)",
        param="model",
        code="model_not_found",
    )


async def _lora_body(request: Request, fields: tuple[str, ...]) -> dict:
    front = state_of(request)
    front.authorize(request)  # the key first: a stranger learns nothing of what is served
    if front.settings.loras is None:
        raise ApiError(404, "LoRA adapters are off here", code="not_found")
    raw = await front.read_body(request)
    try:
        body = json.loads(raw)
    except ValueError:
        raise ApiError(400, "the body is not JSON", code="invalid_body") from None
    except RecursionError:  # nested past Python's limit: no field of this body is
        raise ApiError(
            400, "the body is nested too deeply: send its fields flat", code="invalid_body"
        ) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_body")
    for name in fields:
        if not isinstance(body.get(name), str) or not body[name]:
            raise ApiError(400, f"{name} must be a non-empty string", param=name)
    return body


async def _adapter_call(request: Request, fn, *args) -> None:
    try:
        await asyncio.to_thread(fn, *args)
    except AdapterCallError as e:
        raise ApiError.of_status(e.status, e.message, e.param) from None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request):
    body = await _lora_body(request, ("lora_name", "lora_path"))
    loras = state_of(request).settings.loras
    await _adapter_call(request, loras.load, body["lora_name"], body["lora_path"])
    return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    body = await _lora_body(request, ("lora_name",))
    loras = state_of(request).settings.loras
    await _adapter_call(request, loras.unload, body["lora_name"])
    return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")
