"""The HTTP front's endpoints that say what is served:

    GET  /version             {"version"}: pdserve's (no key needed, as vLLM's)
    GET  /v1/models           the served model (the router's gRPC ListModels)
    GET  /v1/models/{id}      that model's card; 404 (model_not_found) for another id

The models come from the router's own gRPC API, with the client's key, so a caller whose key
the router refuses gets the same 401 as on gRPC. The routes are declared on `router`, which
build_app (router/openai/app.py) includes; they keep no state of their own.
"""

from __future__ import annotations

import time

import grpc
from fastapi import APIRouter, Request

from pdserve import __version__
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.state import state_of

router = APIRouter()


def model_card(m, created: int) -> dict:
    return {
        "id": m.id,
        "object": "model",
        "created": created,
        "owned_by": "pdserve",
        "root": m.id,
        "max_model_len": m.max_model_len,
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
