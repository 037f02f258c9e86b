"""One generation request of the HTTP front, from its gRPC requests to its HTTP response: the
completions and chat endpoints build the gRPC GenerateRequests of a body, and `generate` runs
them on the router's own gRPC API (through the front's in-process channel), so admission,
routing, retries and aborts are the gRPC path's.

`generate` starts the call (a batch of prompts: one call per prompt, read as one by _BatchCall),
watches the client while it waits for the first response, then either hands the call to a
streamed response (router/openai/responses/stream.py), which owns it from then on, or collects
it into a whole one (responses/whole.py). A client that disconnects cancels the gRPC call, which
the router turns into aborts on both pools; however the request ends, its calls are cancelled
(a no-op for those already finished). Errors use OpenAI's error object with the HTTP status of
the failure; a failure after a stream started is sent as one such event, then `data: [DONE]`.
The usage and the `pdserve` extension (protos/timings.py) are in every response, and in a
stream on its last chunk. Nothing outlives the request.

Request ids (vLLM's `_base_request_id`): the client's X-Request-Id header, else the body's
`request_id`, else an id minted here, is the request's public id (`RequestId`): the response's id
(`chatcmpl-<id>`, `cmpl-<id>`; /v1/messages' `msg_<id>`) and the `x-request-id` and `request-id`
response headers (the openai and anthropic SDKs' `_request_id`). The router's request id
(GenerateRequest.request_id, in the router's log lines and traces, and the `pdserve`
extension's `request_id`) is `http-<id>`, with a random suffix when the client chose the id: the
router refuses a request_id already in flight on the front's one channel (ALREADY_EXISTS), so
two clients that send the same id must not meet there. An id that is not 1 to
MAX_REQUEST_ID_CHARS visible ASCII characters is a 400 naming the header or the field.
`RequestIdHeaders`, the app's middleware, puts the headers on every other answer too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers, MutableHeaders

from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.protocol import name_field
from pdserve.router.openai.responses.reasoning import Reading, reading_of
from pdserve.router.openai.responses.stream import (
    chunks,
    prompt_tokens_of,
    response_id,
    rest,
    stream,
)
from pdserve.router.openai.responses.whole import whole_response
from pdserve.router.openai.state import ClientGone, state_of

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# A whole response of more token entries than this (is_large) is built and serialized on
# _BUILDER: with logprobs, each entry is a tokenizer.decode and a dict per alternative, and n
# choices of a long prompt's logprobs would stall every other connection on the event loop for
# seconds. _BUILDER's threads are apart from the default executor that parses every body
# (router/openai/state.py), so such responses queue behind one another, not ahead of a parse.
WHOLE_ON_LOOP_TOKENS = 4096
_BUILDER = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="http-whole")
# A client's request id (X-Request-Id, or the body's request_id) is at most this many visible
# ASCII characters: room for Envoy's UUIDs and W3C trace ids, while the router's id made of it
# (http-<id>-<suffix>-<prompt index>) stays within the router's 256 (protos/limits.py).
MAX_REQUEST_ID_CHARS = 128
# the response headers that carry the request's id: OpenAI's (the openai SDK's `_request_id`),
# then Anthropic's (the anthropic SDK's)
ID_HEADERS = ("x-request-id", "request-id")
_STATE_KEY = "pdserve_request_id"  # request.state's: the request's RequestId, once known


@dataclass(frozen=True)
class RequestId:
    """A request's ids: `public`, the client's (or one minted here), which its response's id and
    headers carry, and `router`, the GenerateRequest.request_id made of it, unique in the
    router."""

    public: str
    router: str


def checked_request_id(value: str | None, name: str) -> str | None:
    """A client's request id as given (None when absent or empty); ApiError 400 naming `name`
    when it is longer than MAX_REQUEST_ID_CHARS or holds anything but visible ASCII."""
    if not value:
        return None
    if len(value) <= MAX_REQUEST_ID_CHARS and all("!" <= c <= "~" for c in value):
        return value
    raise ApiError(
        400,
        f"{name} must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII characters (letters, digits "
        f"and punctuation; no spaces or control characters), got {len(value)} characters: send "
        f"such an id, or none and one is made",
        param=name,
        code="invalid_request_id",
    )


def request_id_of(request: Request, body=None) -> RequestId:
    """The request's ids (kept on request.state, so every caller gets the same): the client's
    X-Request-Id header, else the body's `request_id`, made unique for the router; else a new
    id. ApiError 400 for a client's id that is not one (checked_request_id)."""
    known = getattr(request.state, _STATE_KEY, None)
    if known is not None:
        return known
    given = checked_request_id(request.headers.get("x-request-id"), "X-Request-Id")
    if given is None:
        given = checked_request_id(getattr(body, "request_id", None), "request_id")
    if given is None:
        minted = uuid.uuid4().hex
        ids = RequestId(minted, f"http-{minted}")
    else:  # the router keeps one call per id: two clients' same id must not meet there
        ids = RequestId(given, f"http-{given}-{uuid.uuid4().hex[:12]}")
    setattr(request.state, _STATE_KEY, ids)
    return ids


def id_headers(public: str) -> dict[str, str]:
    """The response headers that give the client the request's id."""
    return dict.fromkeys(ID_HEADERS, public)


class RequestIdHeaders:
    """The app's middleware (build_app adds it outside the error handlers, so a 500 gets it too)
    that puts the request's id in ID_HEADERS on every HTTP answer: the id a generation request
    took (request_id_of: the body's request_id counts there), else the client's X-Request-Id,
    else a new one, as vLLM's XRequestIdMiddleware echoes the header or a new UUID. A client's
    X-Request-Id that is not an id is a 400 on every path, naming the header, before any handler
    runs; its answer carries a new id."""

    def __init__(self, app, front):
        self._app, self._front = app, front

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self._app(scope, receive, send)
        state = scope.setdefault("state", {})  # request.state's own dict (Starlette's)
        app = self._app
        try:
            given = checked_request_id(Headers(scope=scope).get("x-request-id"), "X-Request-Id")
        except ApiError as e:
            given, app = None, self._front.answer(e, scope.get("path", ""))

        async def with_id(message):
            if message["type"] == "http.response.start":
                ids = state.get(_STATE_KEY)
                public = ids.public if ids is not None else given or uuid.uuid4().hex
                message.setdefault("headers", [])
                headers = MutableHeaders(scope=message)
                for name in ID_HEADERS:
                    if name not in headers:  # (generate's own answers name theirs already)
                        headers[name] = public
            await send(message)

        await app(scope, receive, with_id)


async def generate(request: Request, gens: list, metadata, body, chat: bool, shape=None):
    """The HTTP response of running `gens` (one per prompt) for `body` with the key's
    `metadata`: a stream when the body asks for one, else one JSON response. `shape` (None:
    OpenAI's completion and chat shapes) rewrites a chat's response as another API's:
    `shape.whole(chat_completion)` a JSON response, `shape.events(chunks)` a stream's bytes
    (router/openai/responses_api.py's /v1/responses)."""
    front = state_of(request)
    ids = request_id_of(request, body)
    request_id = ids.router
    call = _start(front, gens, metadata, body.n, request_id)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, call))
    streaming = False  # once true, the stream's response owns the call
    try:
        try:
            first = await _from_router(call.read(), watcher)
        except ApiError as e:  # a refusal of something the body set: name the body's field
            name_field(e, body)
            if shape is None:  # (another API's shape has fields of its own names)
                name_client_field(e, body, chat)
            raise
        if first is grpc.aio.EOF:
            raise _no_response()
        model_id, text_of = _echoed(front, body)
        if body.stream:
            watcher.cancel()  # Starlette's StreamingResponse watches from here on
            streaming = True
            args = (call, first, body, chat, model_id, request_id, text_of)
            named = {"public_id": ids.public}
            return _CallStream(
                call,
                stream(*args, **named) if shape is None else shape.events(chunks(*args, **named)),
                media_type="text/event-stream",
                headers={**_SSE_HEADERS, **id_headers(ids.public)},
            )
        responses = [first] + await _from_router(_all(rest(call)), watcher)
        reading = await reading_of(call) if chat else Reading()
        aborts = shape is None  # finish_reason "abort": OpenAI's shapes (parts.finish_reason)
        args = (responses, body, chat, model_id, request_id, text_of, reading, aborts)
        large = is_large(responses, body)
        out = await _off_loop(large, whole_response, *args)
        out["id"] = response_id(chat, ids.public)
        # (a shape's store, responses_api.Keep, is written here on the loop, which it is for)
        answer = functools.partial(JSONResponse, headers=id_headers(ids.public))
        return await _off_loop(large, answer, out if shape is None else shape.whole(out))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it: the client left
    finally:
        watcher.cancel()
        if not streaming:
            call.cancel()  # no-op once finished; a batch's other calls stop here


async def generate_detached(front, gens: list, metadata, body, chat: bool) -> dict:
    """The whole completion (or chat completion) of `gens` for no waiting client: a background
    response (router/openai/responses_api.py). The call runs until it ends, or until the task
    awaiting this is cancelled, which cancels it (the router aborts it on both pools)."""
    request_id = f"http-{uuid.uuid4().hex}"
    call = _start(front, gens, metadata, body.n, request_id)
    try:
        responses = await _all(rest(call))
        reading = await reading_of(call) if chat else Reading()
    except grpc.RpcError as e:
        error = ApiError.from_grpc(e)
        name_field(error, body)
        raise error from None
    finally:
        call.cancel()
    if not responses:
        raise _no_response()
    model_id, text_of = _echoed(front, body)
    args = (responses, body, chat, model_id, request_id, text_of, reading)
    return await _off_loop(is_large(responses, body), whole_response, *args)


def name_client_field(error: ApiError, body, chat: bool) -> None:
    """A router's refusal of the prompt or its length, renamed in place to the chat or
    completions body's field that is at fault, as `param` and in the message: the max_tokens or
    max_completion_tokens the client sent (or min_tokens) where the completion asked for does not
    fit, else the prompt ("messages" for a chat) that is too long, empty or (token ids) out of
    the vocabulary. Any other error, or one that names its field already, is left as it is."""
    if error.status != 400 or error.param is not None:
        return
    prompt = "messages" if chat else "prompt"
    message = error.message
    if error.code == "context_length_exceeded":
        max_field = _max_tokens_field(body)
        if message.startswith("sampling.max_tokens="):  # more than max_model_len on its own
            error.message = max_field + message.removeprefix("sampling.max_tokens")
            error.param = max_field
        elif message.startswith("sampling.min_tokens=") or "min_tokens can be at most" in message:
            error.message = message.removeprefix("sampling.")
            error.param = "min_tokens"
        elif "max_tokens can be at most" in message:  # the prompt and it past the context
            error.message = message.replace("max_tokens can be", f"{max_field} can be")
            error.param = max_field
        elif message.startswith("the prediction has"):
            error.param = "prediction"
        else:  # the prompt alone is longer than the context holds
            error.param = prompt
    elif message.startswith("prompt is empty") or message.startswith(
        "token_ids must be below the vocabulary size"
    ):
        error.param = prompt


def _max_tokens_field(body) -> str:
    """The field the client set the completion's length with (max_tokens when neither)."""
    if getattr(body, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    return "max_tokens"


def is_large(responses: list, body) -> bool:
    """Whether a whole response is built and serialized off the event loop: its sequences'
    tokens, and the prompt positions whose logprobs it gives, times one plus the alternatives
    asked for each, come to more than WHOLE_ON_LOOP_TOKENS."""
    tokens = sum(len(r.delta.token_ids) for r in responses if r.HasField("delta"))
    k = body.prompt_logprobs_k()
    if k is not None:
        tokens += sum(len(r.finish.prompt_logprobs) for r in responses if r.HasField("finish"))
    if body.wants_logprobs or k is not None:
        tokens *= 1 + max(body.num_top(), k or 0)
    return tokens > WHOLE_ON_LOOP_TOKENS


async def _off_loop(large: bool, fn, *args):
    """fn(*args): on _BUILDER's threads when `large`, else here on the event loop (a thread's
    hop costs more than a small response's work)."""
    if not large:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_BUILDER, fn, *args)


def _no_response() -> ApiError:
    return ApiError(500, "the router ended the call without a response", "server_error")


def _echoed(front, body):
    """The model the body named (the router served it: the base or a LoRA adapter), as vLLM
    echoes it, and how a logprob's token is written: by its id (vLLM's
    return_tokens_as_token_ids), else as its text."""
    model_id = getattr(body, "model", None) or front.settings.model_id
    text_of = front.ids_of if getattr(body, "return_tokens_as_token_ids", None) else front.text_of
    return model_id, text_of


def _start(front, gens: list, metadata, n: int, request_id: str):
    """The gRPC call of `gens`: the one call of one prompt, or a batch's calls read as one. A
    request larger than the router takes is refused first (413), none of its calls started."""
    for gen in gens:
        front.check_request_size(gen)
    stub = front.stub
    if len(gens) == 1:
        gens[0].request_id = request_id
        return stub.Generate(gens[0], metadata=metadata)
    for i, gen in enumerate(gens):  # a batch: one call per prompt, their responses one stream
        gen.request_id = f"{request_id}-{i}"
    return _BatchCall([stub.Generate(gen, metadata=metadata) for gen in gens], n)


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

    async def prompt_counts(self) -> list[int]:
        """Each prompt's token count (the router's initial metadata of each call)."""
        return [prompt_tokens_of(await c.initial_metadata()) for c in self._calls]

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
