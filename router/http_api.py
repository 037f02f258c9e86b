"""The OpenAI-compatible HTTP front of the router: the FastAPI app (`build_app`) and its responses.
The router's HttpFront (router/http_server.py) builds the app once and serves it with uvicorn
inside the router process, next to gRPC, until the router stops (docs/architecture.md section 1).

    GET  /v1/models             the served model (gRPC ListModels)
    GET  /v1/models/{id}        that model, 404 for another id
    POST /v1/completions        a prompt, or a batch of them  -> gRPC Generate, one call per prompt
    POST /v1/chat/completions   messages (the model's chat template)  -> gRPC Generate
    POST /tokenize, /detokenize vLLM's: a prompt or messages to token ids, and back
    GET  /version               pdserve's version (no key needed)
    GET  /openapi.json, /docs   the OpenAPI document and its page (no key needed)
    GET  /health                200 while every pool has a worker, else 503 (no key needed)
    GET  /metrics               the router's Prometheus registry, no *_created series (a key:
                                the metrics keys' when set, else the client keys' when set)

Every request takes one path: its handler checks the key, reads the body, validates it
(router/openai_schema.py), and calls the router's own gRPC API through an in-process grpc.aio
channel, so admission, routing, retries and aborts are the gRPC path's. OpenAI's shapes, and the
gRPC status each error maps to, are router/openai_format.py's (whole responses
router/openai_response.py's, streams router/http_stream.py's, the endpoints beyond generation
router/http_extra.py's); `build_app` says more.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import grpc.aio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pdserve import __version__
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.protos.security import API_KEY_METADATA_KEY, bearer_token
from pdserve.router.http_conn import CLOSED_BY
from pdserve.router.http_extra import (
    add_extra_routes,
    chat_messages,
    document_bodies,
)
from pdserve.router.http_stream import rest, stream
from pdserve.router.metrics import exposition
from pdserve.router.openai_format import (
    KNOWN_FIELDS,
    ApiError,
    sampling_params,
    validation_error,
)
from pdserve.router.openai_logprobs import TokenText
from pdserve.router.openai_response import whole_response
from pdserve.router.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pdserve.router.openai_structured import name_field

if TYPE_CHECKING:
    from pdserve.router.http_server import HttpFront

log = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The HTTP client disconnected (its gRPC call, if any, was cancelled)."""


# why the front closed a connection whose body it was reading (router/http_conn.py)
_CLOSED_BY = {
    "body_timeout": "its body stalled: closed (408)",
    "evicted": "its body stalled: closed for a new connection at the connection cap",
}


# ---- the app ---------------------------------------------------------------------------------
def build_app(front: HttpFront) -> FastAPI:
    """The app that `front` serves. The body is bounded by its Content-Length and by the bytes
    actually read. The client's key is forwarded in the `authorization` metadata, so the gRPC
    interceptor (protos/security.py) checks it exactly as for a gRPC client; the front checks it
    first only to refuse a stranger before it reads the body. A client that disconnects cancels
    the gRPC call, which the router turns into aborts on both pools; one gone while its body is
    read (or closed by the front's body timeout, router/http_conn.py) is one INFO line. Errors
    use OpenAI's error object, {"error": {"message", "type", "param", "code"}}, with the HTTP
    status of the failure; a failure after a stream started is sent as one such event, then
    `data: [DONE]`. The usage and the `pdserve` extension (per-stage timings:
    protos/timings.py) are in every response, and in a stream on its last chunk."""
    s = front.settings
    app = FastAPI(
        title="pdserve",
        version=__version__,
        description="pdserve's OpenAI-compatible API (router/http_api.py)",
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    text_of = TokenText(s.tokenizer)
    # a tokenizer whose <tool_call> is a special token (vLLM's Hermes parser keeps them too)
    tags_special = "<tool_call>" in (getattr(s.tokenizer, "all_special_tokens", None) or ())

    def answer(e: ApiError):
        s.on_error(e.status)
        return e.response()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return answer(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = f"{request.method} {request.url.path[:200]}: {e.detail}"
        return answer(ApiError(e.status_code, message, code=code))

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, e: ClientGone):
        log.info("HTTP %s %s: %s", request.method, request.url.path[:200], e)
        return Response(status_code=499)  # nobody reads it: the client left

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("HTTP %s %s failed", request.method, request.url.path[:200])
        return answer(ApiError(500, f"internal error: {type(e).__name__}", "server_error"))

    def authorize(request: Request) -> tuple[tuple[str, str], ...]:
        """The metadata the gRPC call carries: the client's key, checked here first."""
        header = request.headers.get("authorization")
        if not s.keys:
            return ()
        if not s.keys.accepts_header(header):
            raise ApiError(
                401,
                "a valid API key is required: send the header 'Authorization: Bearer <key>'"
                if header is None
                else "the API key is not valid (expected 'Authorization: Bearer <key>')",
                "authentication_error",
                code="invalid_api_key",
            )
        return ((API_KEY_METADATA_KEY, f"Bearer {bearer_token(header)}"),)

    async def read_body(request: Request) -> bytes:
        limit = s.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit() or len(length) > 19:
                raise ApiError(400, "Content-Length is not a number", code="invalid_body")
            if int(length) > limit:
                raise ApiError(
                    413,
                    f"the body has {length} bytes; at most {limit} are accepted",
                    code="body_too_large",
                )
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(
                        413,
                        f"the body has more than {limit} bytes, the most accepted",
                        code="body_too_large",
                    )
                chunks.append(chunk)
        except ClientDisconnect:  # one line (_client_gone), not a server error's traceback
            why = _CLOSED_BY.get(request.scope.get(CLOSED_BY), "the client disconnected")
            of = f" of {length}" if length is not None else ""
            raise ClientGone(f"{why} after {size}{of} body bytes") from None
        return b"".join(chunks)

    def check_prompt_size(texts: list[str], param: str) -> None:
        limit = s.max_prompt_bytes
        chars = sum(len(t) for t in texts)
        if not limit or chars * 4 <= limit:
            return
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if size > limit:
            raise ApiError(
                400,
                f"{param} has {size} bytes, more than max_model_len={s.max_model_len} tokens can "
                f"hold (at most {limit} bytes): shorten it",
                param=param,
                code="context_length_exceeded",
            )

    async def parse(request: Request, model):
        metadata = authorize(request)
        body = await read_body(request)
        try:
            # off the event loop: a body's checks may compile up to MAX_TOOLS tool schemas
            # (router/openai_tools.py), which must not stall every other connection
            return await asyncio.to_thread(model.model_validate_json, body), metadata
        except ValidationError as e:
            raise validation_error(e, KNOWN_FIELDS) from None

    @app.get("/health")
    async def health():
        why = s.ready()
        if why:
            # a probe's answer, not a failed request: not counted as an error
            return ApiError(503, why, "server_error", code="service_unavailable").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request):
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
            authorize(request)
        data = exposition(s.metrics_registry) if s.metrics_registry is not None else b""
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, metadata = await parse(request, CompletionRequest)
        prompts = body.prompts()
        for text in (p for p in prompts if isinstance(p, str)):
            check_prompt_size([text], "prompt")
        sampling = sampling_params(body, body.max_new_tokens())
        gens = []
        for prompt in prompts:
            gen = pdserve_pb2.GenerateRequest(model=body.model or "", sampling=sampling)
            if isinstance(prompt, str):
                gen.text = prompt
            else:
                gen.token_ids.ids.extend(prompt)
            gens.append(gen)
        return await run(request, gens, metadata, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, metadata = await parse(request, ChatCompletionRequest)
        check_prompt_size([t for m in body.messages for t in (m.role, m.text())], "messages")
        # unset: until the sequence fills the context (OpenAI's and vLLM's chat default)
        most = body.max_new_tokens() or s.max_model_len or None
        gen = pdserve_pb2.GenerateRequest(
            model=body.model or "", sampling=sampling_params(body, most)
        )
        if body.tool_mode() == "auto" and body.skip_special_tokens is None and tags_special:
            gen.sampling.skip_special_tokens = False  # the <tool_call> tags must reach the parser
        gen.chat.CopyFrom(chat_messages(body))
        return await run(request, [gen], metadata, body, chat=True)

    async def run(request: Request, gens: list, metadata, body, chat: bool):
        request_id = f"http-{uuid.uuid4().hex}"
        if len(gens) == 1:
            gens[0].request_id = request_id
            call = front.stub.Generate(gens[0], metadata=metadata)
        else:  # a batch: one call per prompt, their responses read as one stream
            for i, gen in enumerate(gens):
                gen.request_id = f"{request_id}-{i}"
            calls = [front.stub.Generate(gen, metadata=metadata) for gen in gens]
            call = _BatchCall(calls, body.n)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, call))
        streaming = False  # once true, the stream's response owns the call
        try:
            try:
                first = await _from_router(call.read(), watcher)
            except ApiError as e:  # a structured spec the workers refused: name the body's field
                name_field(e, body)
                raise
            if first is grpc.aio.EOF:
                raise ApiError(500, "the router ended the call without a response", "server_error")
            if body.stream:
                watcher.cancel()  # Starlette's StreamingResponse watches from here on
                streaming = True
                return _CallStream(
                    call,
                    stream(call, first, body, chat, s.model_id, request_id, text_of),
                    media_type="text/event-stream",
                    headers=_SSE_HEADERS,
                )
            responses = [first] + await _from_router(_all(rest(call)), watcher)
            return JSONResponse(
                whole_response(responses, body, chat, s.model_id, request_id, text_of)
            )
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: the client left
        finally:
            watcher.cancel()
            if not streaming:
                call.cancel()  # no-op once finished; a batch's other calls stop here

    add_extra_routes(app, front, authorize, parse)
    document_bodies(
        app,
        {
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
            "/tokenize": TokenizeRequest,
            "/detokenize": DetokenizeRequest,
        },
    )
    return app


class _BatchCall:
    """The gRPC calls of a batch of prompts read as one call: `read` gives the next response of
    any of them (first come, first given) with its sequence index moved to prompt i's range
    (i * n + j), EOF once all ended; the first error ends the batch (the caller cancels it)."""

    def __init__(self, calls: list, n: int):
        self._calls, self._n = calls, n
        # one pending read per call still open -> the call's prompt index
        self._reads = {asyncio.ensure_future(c.read()): i for i, c in enumerate(calls)}
        self._ready: list = []

    async def read(self):
        while not self._ready and self._reads:
            done, _ = await asyncio.wait(self._reads, return_when=asyncio.FIRST_COMPLETED)
            if any(task.cancelled() for task in done):  # cancel() ran: the client is gone
                raise asyncio.CancelledError()
            errors = [task.exception() for task in done if task.exception() is not None]
            if errors:
                raise errors[0]
            for task in done:
                i = self._reads.pop(task)
                msg = task.result()
                if msg is grpc.aio.EOF:
                    continue
                event = msg.delta if msg.HasField("delta") else msg.finish
                event.index += i * self._n
                self._ready.append(msg)
                self._reads[asyncio.ensure_future(self._calls[i].read())] = i
        return self._ready.pop(0) if self._ready else grpc.aio.EOF

    def cancel(self) -> None:
        for task in self._reads:
            task.cancel()
        for call in self._calls:
            call.cancel()


class _CallStream(StreamingResponse):
    """The SSE response of one gRPC call, which it cancels however the response ends: finished,
    the client gone (Starlette cancels the body), or never started at all."""

    def __init__(self, call, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._call = call

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._call.cancel()  # no-op once the call finished


async def _from_router(awaitable, watcher: asyncio.Task):
    """What `awaitable` (a read of the router's call) gives; the call's gRPC error as the HTTP
    error, and a cancellation by _cancel_on_disconnect (`watcher` done) as ClientGone."""
    try:
        return await awaitable
    except asyncio.CancelledError:
        if watcher.done():
            raise ClientGone() from None
        raise
    except grpc.RpcError as e:
        raise ApiError.from_grpc(e) from None


async def _all(responses: AsyncIterator) -> list:
    return [r async for r in responses]


async def _cancel_on_disconnect(request: Request, call) -> None:
    """Waits for the client to disconnect, then cancels its gRPC call (the router aborts the
    request on both pools)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            call.cancel()
            return
