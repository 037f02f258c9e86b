"""The OpenAI-compatible HTTP front of the router: FastAPI served by uvicorn inside the router
process, next to gRPC (docs/architecture.md section 1).

    GET  /v1/models             the served model (gRPC ListModels)
    POST /v1/completions        a prompt (text or token ids)          -> gRPC Generate
    POST /v1/chat/completions   messages (the model's chat template)  -> gRPC Generate
    GET  /health                200 while every pool has a worker, else 503 (no key needed)
    GET  /metrics               the router's Prometheus registry (needs a key when keys are set)

One path for every request: a handler checks the key, reads the body (bounded: Content-Length and
the bytes actually read), validates it (router/openai_schema.py), then calls the router's own
gRPC API through an in-process grpc.aio channel, so the router's validation, admission, routing,
retries and aborts are the gRPC ones. The channel goes to a Unix socket in a private (0700)
directory that the gRPC server also listens on: the loopback path needs neither the client
port's TLS nor a client certificate, and no TCP port is opened for it. The client's key is
forwarded in the `authorization` metadata, so the gRPC interceptor (protos/security.py) checks it
exactly as for a gRPC client; the HTTP front checks it first only to refuse a stranger before it
reads the body. A client that disconnects cancels the gRPC call, which the router turns into
aborts on both pools (router/service.py).

uvicorn runs on a thread of its own with its own event loop, so no gRPC thread ever waits on HTTP;
Router.stop() stops it first (open streams are cancelled after the grace period).

Errors use OpenAI's error object, {"error": {"message", "type", "param", "code"}}, with the HTTP
status of the failure; a failure after a stream started is sent as one such event, then
`data: [DONE]`. The usage and `pdserve` extension (per-stage timings from router/stage_timings.py,
the prefill and decode worker) are in every response, and in a stream on its last chunk. Those
shapes, and the gRPC status each error maps to, are router/openai_format.py's; this module is the
server around them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import grpc.aio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
from protos.security import API_KEY_METADATA_KEY, NO_KEYS, ClientKeys, TLSConfig, bearer_token
from router.openai_format import (
    KNOWN_FIELDS,
    ApiError,
    TokenText,
    chat_logprobs,
    check_logprobs,
    completion_logprobs,
    extension,
    finish_reason,
    sampling_params,
    sse,
    usage,
    validation_error,
    whole_response,
)
from router.openai_schema import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def default_max_body_bytes(max_model_len: int, max_prompt_bytes: int) -> int:
    """The largest body a valid request can have, at least 4 MiB: a prompt of max_prompt_bytes
    written as JSON escapes (at most 6 bytes per UTF-8 byte: `\\u00e9`), or max_model_len token
    ids of 11 characters each, plus a MiB for the other fields at their caps."""
    return max(4 << 20, 6 * max_prompt_bytes + 12 * max_model_len + (1 << 20))


class ClientGone(Exception):
    """The HTTP client disconnected; its gRPC call was cancelled."""


# ---- the server ------------------------------------------------------------------------------
@dataclass
class HttpSettings:
    host: str
    port: int  # 0: a free port
    model_id: str
    tokenizer: object
    keys: ClientKeys = NO_KEYS
    tls: TLSConfig | None = None
    max_body_bytes: int = 4 << 20
    max_model_len: int = 0
    # a prompt (or chat) longer in UTF-8 bytes cannot fit max_model_len tokens (router/text.py):
    # refused here, before a gRPC message that may exceed the gRPC port's size limit; 0: no check
    max_prompt_bytes: int = 0
    metrics_registry: object = None
    ready: Callable[[], str | None] = lambda: None  # None: serving; else why not
    grace_s: float = 1.0


class HttpFront:
    """uvicorn on its own thread and event loop, serving build_app()."""

    def __init__(self, settings: HttpSettings):
        self.settings = settings
        self.address: str | None = None
        self.scheme = "https" if settings.tls is not None else "http"
        # 0700: only this user; a short path (a Unix socket's path has ~100 bytes at most)
        base = tempfile.gettempdir()
        self._dir = tempfile.mkdtemp(prefix="pdserve-http-", dir=base if len(base) < 64 else "/tmp")
        self.grpc_target = f"unix:{os.path.join(self._dir, 'grpc.sock')}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.stub: pdserve_pb2_grpc.PDServeStub | None = None

    def add_internal_port(self, grpc_server: grpc.Server) -> None:
        """The Unix socket the HTTP handlers call gRPC through; before grpc_server.start()."""
        grpc_server.add_insecure_port(self.grpc_target)

    def start(self, timeout_s: float = 30.0) -> HttpFront:
        s = self.settings
        sock = _bind(s.host, s.port)
        try:
            config = uvicorn.Config(
                build_app(self),
                log_config=None,  # the process's logging stays as it is
                access_log=False,
                http="h11",
                ws="none",
                lifespan="off",
                loop="asyncio",
                server_header=False,
                timeout_graceful_shutdown=max(1, math.ceil(s.grace_s)),
                **self._ssl_options(),
            )
            config.load()  # reads the TLS files now; they are deleted right after
        except BaseException:
            sock.close()
            raise
        finally:
            self._remove_tls_files()
        self._server = uvicorn.Server(config)
        port = sock.getsockname()[1]
        host = f"[{s.host}]" if ":" in s.host else s.host
        self.address = f"{host}:{port}"
        self._thread = threading.Thread(
            target=self._run, args=(sock,), name="router-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise OSError(
                    f"the HTTP front did not start on {self.address}: {self._error or 'timeout'}"
                )
            time.sleep(0.01)
        return self

    def _ssl_options(self) -> dict:
        tls = self.settings.tls
        if tls is None:
            return {}
        paths = {}
        for name, data in (("cert", tls.cert_pem), ("key", tls.key_pem), ("ca", tls.ca_pem)):
            if not data:
                continue
            path = os.path.join(self._dir, f"{name}.pem")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            paths[name] = path
        options = dict(ssl_certfile=paths["cert"], ssl_keyfile=paths["key"])
        if "ca" in paths:  # as the gRPC client port: clients must show a certificate it signed
            import ssl

            options.update(ssl_ca_certs=paths["ca"], ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options

    def _remove_tls_files(self) -> None:
        for name in ("cert", "key", "ca"):
            try:
                os.unlink(os.path.join(self._dir, f"{name}.pem"))
            except FileNotFoundError:
                pass

    def _run(self, sock: socket.socket) -> None:
        async def serve():
            channel = grpc.aio.insecure_channel(self.grpc_target)
            self.stub = pdserve_pb2_grpc.PDServeStub(channel)
            try:
                await self._server.serve(sockets=[sock])
            finally:
                await channel.close(grace=None)

        try:
            asyncio.run(serve())
        except BaseException as e:  # noqa: BLE001 - reported by start() or logged
            self._error = e
            log.exception("the HTTP front stopped")
        finally:
            sock.close()

    def stop(self) -> None:
        """Stops taking requests; open streams get the grace period, then are cancelled (which
        cancels their gRPC calls)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(self.settings.grace_s + 5)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True
                self._thread.join(5)
            self._thread = None
        shutil.rmtree(self._dir, ignore_errors=True)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen for HTTP on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


# ---- the app ---------------------------------------------------------------------------------
def build_app(front: HttpFront) -> FastAPI:
    s = front.settings
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    text_of = TokenText(s.tokenizer)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = f"{request.method} {request.url.path[:200]}: {e.detail}"
        return ApiError(e.status_code, message, code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("HTTP %s %s failed", request.method, request.url.path[:200])
        return ApiError(500, f"internal error: {type(e).__name__}", "server_error").response()

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
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(
                    413,
                    f"the body has more than {limit} bytes, the most accepted",
                    code="body_too_large",
                )
            chunks.append(chunk)
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
            return model.model_validate_json(body), metadata
        except ValidationError as e:
            raise validation_error(e, KNOWN_FIELDS) from None

    @app.get("/health")
    async def health():
        why = s.ready()
        if why:
            return ApiError(503, why, "server_error", code="service_unavailable").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request):
        authorize(request)
        data = generate_latest(s.metrics_registry) if s.metrics_registry is not None else b""
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        metadata = authorize(request)
        try:
            reply = await front.stub.ListModels(
                pdserve_pb2.ListModelsRequest(), metadata=metadata, timeout=30
            )
        except grpc.RpcError as e:
            raise ApiError.from_grpc(e) from None
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": m.id,
                    "object": "model",
                    "created": created,
                    "owned_by": "pdserve",
                    "root": m.id,
                    "max_model_len": m.max_model_len,
                }
                for m in reply.models
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, metadata = await parse(request, CompletionRequest)
        prompt = body.prompt_value()
        gen = pdserve_pb2.GenerateRequest(
            model=body.model,
            sampling=sampling_params(body, body.max_tokens, body.logprobs is not None),
        )
        if isinstance(prompt, str):
            check_prompt_size([prompt], "prompt")
            gen.text = prompt
        else:
            gen.token_ids.ids.extend(prompt)
        return await run(request, gen, metadata, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, metadata = await parse(request, ChatCompletionRequest)
        check_prompt_size([t for m in body.messages for t in (m.role, m.text())], "messages")
        # unset: until the sequence fills the context (OpenAI's and vLLM's chat default)
        most = body.max_new_tokens() or s.max_model_len or None
        gen = pdserve_pb2.GenerateRequest(
            model=body.model, sampling=sampling_params(body, most, body.logprobs)
        )
        gen.chat.messages.extend(
            pdserve_pb2.ChatMessage(role=m.template_role(), content=m.text()) for m in body.messages
        )
        return await run(request, gen, metadata, body, chat=True)

    async def run(request: Request, gen, metadata, body, chat: bool):
        gen.request_id = f"http-{uuid.uuid4().hex}"
        call = front.stub.Generate(gen, metadata=metadata)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, call))
        try:
            first = await _from_router(call.read(), watcher)
            if first is grpc.aio.EOF:
                raise ApiError(500, "the router ended the call without a response", "server_error")
            if body.stream:
                watcher.cancel()  # Starlette's StreamingResponse watches from here on
                return _CallStream(
                    call,
                    _stream(call, first, body, chat, s.model_id, gen.request_id, text_of),
                    media_type="text/event-stream",
                    headers=_SSE_HEADERS,
                )
            responses = [first] + await _from_router(_all(_rest(call)), watcher)
            return JSONResponse(
                whole_response(responses, body, chat, s.model_id, gen.request_id, text_of)
            )
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: the client left
        finally:
            watcher.cancel()
            if not body.stream:
                call.cancel()  # no-op once finished

    return app


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


async def _rest(call) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    while True:
        msg = await call.read()
        if msg is grpc.aio.EOF:
            return
        yield msg


async def _stream(call, first, body, chat: bool, model_id: str, request_id: str, text_of):
    """Server-sent events in OpenAI's chunk format: one chunk per TokenDelta, one with the
    finish_reason per sequence, with include_usage a last chunk with empty choices and the usage,
    then `data: [DONE]`. The `pdserve` extension rides on the last chunk before [DONE]."""
    suffix = request_id.removeprefix("http-")
    base = {
        "id": f"chatcmpl-{suffix}" if chat else f"cmpl-{suffix}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_id,
    }
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    want_logprobs = body.logprobs if chat else body.logprobs is not None
    finishes: list[pdserve_pb2.Finish] = []
    offsets: dict[int, int] = {}
    held: dict | None = None  # the latest finish chunk: the extension goes on the last one

    def chunk(choices: list[dict]) -> dict:
        out = {**base, "choices": choices}
        if include_usage:
            out["usage"] = None
        return out

    def choice(index: int, text: str | None, lp, reason: str | None, role: bool = False) -> dict:
        if chat:
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": reason}

    try:
        if chat:  # the assistant role first, one chunk per sequence
            for i in range(body.n):
                yield sse(chunk([choice(i, "", None, None, role=True)]))
        async for r in _prepend(first, call):
            if r.HasField("delta"):
                d = r.delta
                if not d.text and not (want_logprobs and d.token_ids):
                    continue
                lp = None
                if want_logprobs:
                    ids, lps = list(d.token_ids), list(d.logprobs)
                    check_logprobs(ids, lps)
                    if chat:
                        lp = chat_logprobs(ids, lps, text_of)
                    else:
                        lp = completion_logprobs(ids, lps, text_of, offsets.get(d.index, 0))
                        offsets[d.index] = offsets.get(d.index, 0) + sum(
                            len(t) for t in lp["tokens"]
                        )
                out = chunk([choice(d.index, d.text, lp, None)])
                if held is not None:
                    yield sse(held)
                    held = None
                yield sse(out)
            elif r.HasField("finish"):
                f = r.finish
                reason = finish_reason(f)
                finishes.append(f)
                if held is not None:
                    yield sse(held)
                held = chunk([choice(f.index, None if chat else "", None, reason)])
        if include_usage:
            if held is not None:
                yield sse(held)
            held = {**base, "choices": [], "usage": usage(finishes)}
        if held is not None:
            held["pdserve"] = extension(finishes, request_id)
            yield sse(held)
    except grpc.RpcError as e:
        if held is not None:
            yield sse(held)
        yield sse(ApiError.from_grpc(e).body())
    except ApiError as e:
        if held is not None:
            yield sse(held)
        yield sse(e.body())
    finally:
        call.cancel()  # a client gone mid-stream cancels here: the router aborts both legs
    yield sse("[DONE]")


async def _prepend(first, call):
    yield first
    async for r in _rest(call):
        yield r
