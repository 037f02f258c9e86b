"""The OpenAI-compatible HTTP front of the router: the FastAPI app (`build_app`), its error
handlers and its OpenAPI document. The router's HttpFront (router/openai/server.py) builds the
app once and serves it with uvicorn inside the router process, next to gRPC, until the router
stops (docs/architecture.md section 1).

    GET  /v1/models, /v1/models/{id}, /version      router/openai/models.py
    POST /v1/completions                            router/openai/completions.py
    POST /v1/chat/completions                       router/openai/chat.py
    POST /v1/responses                              router/openai/responses_api.py
    POST /v1/messages, /v1/messages/count_tokens    router/openai/messages_api.py (Anthropic's)
    POST /v1/embeddings                             router/openai/embeddings.py
    POST/GET/DELETE /v1/files, /v1/files/{id}[/content]   router/openai/files_api.py
    POST/GET /v1/batches, /v1/batches/{id}[/cancel] router/openai/batches_api.py (OpenAI's Batch
         API: a file's requests run in-process through this app, behind interactive calls)
    POST /v1/score, /v1/rerank, /classify (+ vLLM's  router/openai/scoring.py
         other spellings: /score, /rerank, ...)
    POST /tokenize, /detokenize                     router/openai/tokenize.py
    GET  /health, /metrics (GET/POST /ping)         router/openai/status.py
    POST /pause, /resume, GET /is_paused            router/openai/pause.py
    POST /sleep, /wake_up, GET /is_sleeping         router/openai/sleep.py
    POST /reset_prefix_cache, /flush_cache          router/openai/cache.py
    GET  /openapi.json, /docs                       the OpenAPI document and its page (no key)

Every request takes one path: its handler checks the key, reads and validates the body
(router/openai/state.py, protocol.py) and calls the router's own gRPC API, so admission,
routing, retries and aborts are the gRPC path's. Errors use OpenAI's error object (Anthropic's on
its paths: router/openai/errors.py) with the HTTP status of the failure, each counted by the
settings' on_error; a client gone mid-request is one INFO line and a 499 nobody reads. A 405
names the methods its path takes (Allow).

Browsers: cross-origin calls are off unless the settings list origins (router.cors_allowed_origins
in the deployment YAML). Then Starlette's CORSMiddleware, outside everything else, answers those
origins' preflights without a key and lets their pages read the answers. Off, an OPTIONS is a 405
and no page may read an answer; nor can one make the front work: a POST's body must be declared
JSON (router/openai/state.py check_json_body), which a browser sends to another origin only after
a preflight, and a POST with no body (/pause, a response's cancel) that names an Origin neither
listed nor the front's own is a 403 (ForeignOrigins): a browser sends those without a preflight.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Match

from pdserve import __version__
from pdserve.router.metrics import track_batches
from pdserve.router.openai import (
    batches_api,
    cache,
    chat,
    completions,
    conversations_api,
    embeddings,
    files_api,
    messages_api,
    models,
    pause,
    responses_api,
    scoring,
    sleep,
    status,
    tokenize,
    weights,
)
from pdserve.router.openai.batches_api import Batches
from pdserve.router.openai.conversations_api import ConversationCreate, ItemsCreate
from pdserve.router.openai.embeddings import EmbeddingRequest
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.files_api import FileStore
from pdserve.router.openai.generate import RequestIdHeaders
from pdserve.router.openai.messages_api import CountTokensRequest, MessagesRequest
from pdserve.router.openai.origins import ForeignOrigins
from pdserve.router.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pdserve.router.openai.responses_api import ResponsesRequest
from pdserve.router.openai.scoring import ClassifyRequest, RerankRequest, ScoreRequest
from pdserve.router.openai.state import ClientGone, FrontState

log = logging.getLogger(__name__)

# what an allowed origin's page may send: every method the API serves, and any header (the
# preflight's requested ones are echoed back, as vLLM's default "*" does: the SDKs send
# authorization or x-api-key, anthropic-version, anthropic-dangerous-direct-browser-access,
# OpenAI-Organization, OpenAI-Project and x-stainless-* headers); and the answer's headers its
# script may read besides the safelisted ones: the request ids the SDKs show, and Retry-After
CORS_METHODS = ("GET", "HEAD", "POST", "DELETE")
CORS_EXPOSED_HEADERS = ("x-request-id", "request-id", "retry-after")

# the request body of each POST path, for the OpenAPI document
_BODIES = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/conversations": ConversationCreate,
    "/v1/conversations/{conversation_id}/items": ItemsCreate,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/score": ScoreRequest,
    "/score": ScoreRequest,
    "/v1/rerank": RerankRequest,
    "/rerank": RerankRequest,
    "/v2/rerank": RerankRequest,
    "/classify": ClassifyRequest,
    "/v1/classify": ClassifyRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


def build_app(front) -> FastAPI:
    """The app that `front` (an HttpFront, or anything with its `settings` and `stub`) serves."""
    app = FastAPI(
        title="pdserve",
        version=__version__,
        description="pdserve's OpenAI-compatible API (router/openai/)",
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    state = app.state.front = FrontState(front)
    # the Files and Batch APIs' state: files on the router's disk, and the batches that run
    # their lines through this app (FrontState cannot make them: they import it)
    state.files = FileStore(front.settings.files_store_bytes, front.settings.files_dir)
    state.batches = Batches(state.files, front.settings.batch_max_inflight)
    state.batches.app = app
    if front.settings.metrics_registry is not None:
        track_batches(front.settings.metrics_registry, front.settings.model_id, state.batches)
    _add_error_handlers(app, app.state.front)
    groups = (
        status,
        completions,
        chat,
        responses_api,
        conversations_api,
        messages_api,
        embeddings,
        files_api,
        batches_api,
        scoring,
        models,
        pause,
        sleep,
        cache,
        tokenize,
        weights,
    )
    for group in groups:
        app.include_router(group.router)
    # every route with its methods, for a 405's Allow (allowed_methods)
    app.state.routes = (*app.routes, *(route for g in groups for route in g.router.routes))
    document_bodies(app, _BODIES)
    origins = tuple(front.settings.cors_allowed_origins)
    app.add_middleware(ForeignOrigins, front=app.state.front, origins=origins)
    # outside the error handlers (_Unexpected's 500 included) and the origin check: every
    # answer names its request
    app.add_middleware(RequestIdHeaders, front=app.state.front)
    if origins:  # added last: the outermost layer, so a preflight never reaches the key check
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=CORS_METHODS,
            allow_headers=("*",),
            expose_headers=CORS_EXPOSED_HEADERS,
            # an allowed page served from a public address may call a front on a private one
            # (Chrome's Private Network Access preflight): the origin list is the gate
            allow_private_network=True,
        )
    return app


def _add_error_handlers(app: FastAPI, front: FrontState) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return front.answer(e, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = f"{request.method} {request.url.path[:200]}: {e.detail}"
        response = front.answer(ApiError(e.status_code, message, code=code), request.url.path)
        response.headers.update(e.headers or {})
        if e.status_code == 405:
            response.headers["Allow"] = allowed_methods(request) or response.headers["Allow"]
        return response

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, e: ClientGone):
        log.info("HTTP %s %s: %s", request.method, request.url.path[:200], e)
        return Response(status_code=499)  # nobody reads it: the client left

    app.add_middleware(_Unexpected, front=front)


class _Unexpected:
    """An exception no handler took becomes a 500 with OpenAI's error object, and the client's
    connection stays usable: Starlette's own handler for Exception answers and then re-raises,
    so uvicorn closed the keep-alive connection after every such 500 (the client's next request
    on it failed). A response already under way (a stream) cannot be answered again: the
    exception goes on, and the connection ends."""

    def __init__(self, app, front: FrontState):
        self._app, self._front = app, front

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self._app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._app(scope, receive, tracked)
        except Exception as e:
            if started:
                raise
            path = scope.get("path", "")
            log.exception("HTTP %s %s failed", scope.get("method"), path[:200])
            error = ApiError(500, f"internal error: {type(e).__name__}", "server_error")
            await self._front.answer(error, path)(scope, receive, send)


def allowed_methods(request: Request) -> str:
    """The Allow header of a 405 (RFC 9110): the methods of every route on the request's path.
    Starlette's own names the first such route's alone, so a path with a route per method
    (GET, POST and DELETE /v1/conversations/{id}) would seem to take one of them."""
    methods = set()
    for route in request.app.state.routes:
        methods_of = getattr(route, "methods", None)
        if methods_of and route.matches(request.scope)[0] != Match.NONE:
            methods |= methods_of
    return ", ".join(sorted(methods))


def document_bodies(app: FastAPI, bodies: dict[str, type]) -> None:
    """The OpenAPI document (GET /openapi.json, FastAPI's) with the request body of each POST
    path in `bodies` described by its pydantic model: the handlers read raw requests (to bound
    them before parsing), so FastAPI cannot see them itself."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            ref = {"$ref": f"#/components/schemas/{model.__name__}"}
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": ref}},
            }
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
