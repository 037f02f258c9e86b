"""The HTTP front's endpoints for operators:

    GET  /health    200 while every pool has a worker, else 503 (no key needed)
    GET  /ping      /health's answer under vLLM's (and SageMaker's) name for it; POST too
    GET  /metrics   the router's Prometheus registry, no *_created series (a key: the metrics
                    keys' when set, else the client keys' when set)

A 503 from /health (or /ping) is a probe's answer, not a failed request: it is not counted among
the HTTP errors. The routes are declared on `router`, which build_app (router/openai/app.py)
includes; they read the front's settings and keep no state of their own.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.router.metrics import exposition
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.state import state_of

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    why = state_of(request).settings.ready()
    if why:
        # a probe's answer, not a failed request: not counted as an error
        return ApiError(503, why, "server_error", code="service_unavailable").response()
    return JSONResponse({"status": "ok"})


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request):
    """vLLM's /ping, which SageMaker and some load balancers probe: /health's answer (no key,
    no body read)."""
    return await health(request)


@router.get("/metrics")
async def metrics(request: Request):
    front = state_of(request)
    s = front.settings
    if s.metrics_keys:  # the scrape's own keys (router.metrics_keys_file), not the clients'
        if not s.metrics_keys.accepts_header(request.headers.get("authorization")):
            raise ApiError(
                401,
                "GET /metrics needs a metrics key (router.metrics_keys_file): send the "
                "header 'Authorization: Bearer <key>'",
                "authentication_error",
                code="invalid_api_key",
            )
    else:
        front.authorize(request)
    data = exposition(s.metrics_registry) if s.metrics_registry is not None else b""
    return Response(data, media_type=CONTENT_TYPE_LATEST)
