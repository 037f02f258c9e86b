"""What every handler of the HTTP front shares: the front's settings, its gRPC stub, the token
texts of logprobs, the prompt encoder of /tokenize, and the checks each request goes through
before any work (its key, its body's size, its parsing, its prompt's size, its model), and the
store of /v1/responses' stored responses (router/openai/responses/store.py).

build_app (router/openai/app.py) makes one FrontState per app and keeps it as `app.state.front`; a
handler reaches it with `state_of(request)`. It lives as long as the app, and holds nothing per
request but the stored responses: the stub is read from the front at each call, since the front
opens its channel only once its own event loop runs.

The client's key (the Authorization header's bearer token, or Anthropic's x-api-key header) is
forwarded in the `authorization` metadata, so the gRPC interceptor
(protos/security.py) checks it exactly as for a gRPC client; the front checks it first only to
refuse a stranger before it reads the body. The body must be declared JSON (its Content-Type:
check_json_body), and is bounded by its Content-Length and by the bytes actually read; a client
gone while it is read (or closed by the front's body timeout, router/openai/connections.py)
raises ClientGone, which the app logs as one INFO line.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from concurrent import futures

import grpc
from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from pdserve.engine.tokenizer import reasoning_tags
from pdserve.protos.security import API_KEY_METADATA_KEY, bearer_token
from pdserve.protos.tracing import TRACE_HEADERS
from pdserve.router.admission import BATCH_METADATA_KEY, FAIRNESS_ID_KEY, MAX_FAIRNESS_ID_CHARS
from pdserve.router.chat_tools import HARMONY, TOOL_TAGS, tool_call_format
from pdserve.router.metrics import track_responses
from pdserve.router.openai.connections import CLOSED_BY
from pdserve.router.openai.errors import ApiError, request_too_large, validation_error
from pdserve.router.openai.fim import fim_format
from pdserve.router.openai.protocol import KNOWN_FIELDS
from pdserve.router.openai.responses.logprobs import TokenIdText, TokenText
from pdserve.router.openai.responses.store import ResponseStore
from pdserve.router.server import max_request_bytes
from pdserve.router.text import BadRequest, PromptEncoder

# a batch's line run through the app (router/openai/batches_api.py) carries its batch's id under
# this key of its ASGI scope's state, and its gRPC call carries it as BATCH_METADATA_KEY, which the
# router's admission queues behind interactive calls (router/admission.py)
BATCH_SCOPE_KEY = "pdserve_batch"

# the paths of Anthropic's Messages API (router/openai/messages_api.py): its error shape
ANTHROPIC_PREFIX = "/v1/messages"

# The prompt encoder's calls (/tokenize, /v1/messages/count_tokens, a score template's pairs)
# run on ENCODER_THREADS threads of their own, at most MAX_ENCODER_CALLS running or waiting
# (FrontState.encode); each waits for the router's one tokenizer thread (router/text.py), so
# more threads would only wait longer
ENCODER_THREADS = 2
MAX_ENCODER_CALLS = 64

# why the front closed a connection whose body it was reading (router/openai/connections.py)
_CLOSED_BY = {
    "body_timeout": "its body stalled: closed (408)",
    "evicted": "its body stalled: closed for a new connection at the connection cap",
}


class ClientGone(Exception):
    """The HTTP client disconnected (its gRPC call, if any, was cancelled)."""


class FrontState:
    """The front's shared state and the checks of a request (the module's docstring)."""

    def __init__(self, front):
        s = self.settings = front.settings
        self._front = front
        self.text_of = TokenText(s.tokenizer)
        self.ids_of = TokenIdText(s.tokenizer)  # return_tokens_as_token_ids
        # a tokenizer whose call tag is a special token (vLLM's parsers keep them too),
        # whose </think> is one, or that writes Harmony (gpt-oss's, whose tags are special
        # tokens): a reasoning model's tags must reach the reasoning split (router/openai/chat.py)
        specials = getattr(s.tokenizer, "all_special_tokens", None) or ()
        self.tags_special = any(tag in specials for tag in TOOL_TAGS)
        self.think_special = "</think>" in specials or tool_call_format(s.tokenizer) == HARMONY
        # a reasoning model (its vocabulary has <think> and </think>): Anthropic's thinking
        self.reasons = reasoning_tags(s.tokenizer) is not None
        # a code model's fill-in-the-middle tokens: a completion's suffix (router/openai/fim.py)
        self.fim = fim_format(s.tokenizer)
        self.responses = ResponseStore(s.responses_store_bytes)  # /v1/responses' stored ones
        if s.metrics_registry is not None:
            track_responses(s.metrics_registry, s.model_id, self.responses)
        # the largest gRPC request the router's port takes (router/server.py, from the same
        # two sizes the router gives the front); 0, for a front built without them (tests): not
        # checked here, and gRPC's own refusal is the 413 (router/openai/errors.py)
        self.max_request_bytes = 0
        if s.max_model_len and s.max_prompt_bytes:
            self.max_request_bytes = max_request_bytes(s.max_model_len, s.max_prompt_bytes)
        self._encoding = BoundedPool(ENCODER_THREADS, MAX_ENCODER_CALLS, "http-encode")
        self.encoder = s.encoder
        if self.encoder is None:  # a front built without the router's (tests): one of its own
            self.encoder = PromptEncoder(s.tokenizer, s.max_model_len or (1 << 20))

    @property
    def stub(self):
        return self._front.stub

    def answer(self, e: ApiError, path: str = ""):
        """The error's response to a request for `path`, counted (router.metrics: the HTTP errors
        by status); Anthropic's Messages API paths get its error shape."""
        self.settings.on_error(e.status)
        return e.response(anthropic=path.startswith(ANTHROPIC_PREFIX))

    def authorize(self, request: Request) -> tuple[tuple[str, str], ...]:
        """The metadata the gRPC call carries: the client's key, checked here first, and its W3C
        trace context (traceparent, tracestate: protos/tracing.py; one that is too long or not
        printable is left out, and the router ignores a malformed one), its flow within its
        tenant (FAIRNESS_ID_KEY: the admission queue shares slots between tenants, then between
        their flows; one too long is a 400), and for a batch's line its batch's id
        (BATCH_METADATA_KEY)."""
        trace = tuple(
            (name, value)
            for name in TRACE_HEADERS
            if (value := request.headers.get(name)) is not None
            and len(value) <= 512
            and value.isprintable()
        )
        fairness = request.headers.get(FAIRNESS_ID_KEY)
        if fairness is not None:
            if not (
                len(fairness) <= MAX_FAIRNESS_ID_CHARS
                and fairness.isascii()
                and fairness.isprintable()
            ):
                raise ApiError(
                    400,
                    f"the header {FAIRNESS_ID_KEY} must be at most {MAX_FAIRNESS_ID_CHARS} "
                    f"printable ASCII characters",
                    code="invalid_header",
                )
            trace = (*trace, (FAIRNESS_ID_KEY, fairness))
        batch = request.scope.get("state", {}).get(BATCH_SCOPE_KEY)
        if batch is not None:
            trace = (*trace, (BATCH_METADATA_KEY, batch))
        header = key_header(request)
        if not self.settings.keys:
            return trace
        if not self.settings.keys.accepts_header(header):
            raise ApiError(
                401,
                "a valid API key is required: send the header 'Authorization: Bearer <key>' "
                "(or 'x-api-key: <key>')"
                if header is None
                else "the API key is not valid (expected 'Authorization: Bearer <key>')",
                "authentication_error",
                code="invalid_api_key",
            )
        return ((API_KEY_METADATA_KEY, f"Bearer {bearer_token(header)}"), *trace)

    def owner(self, request: Request) -> str | None:
        """Whose a stored response is (router/openai/responses/store.py): a hash of the client's
        key (checked by `authorize` first); None without API keys, when every client is one."""
        if not self.settings.keys:
            return None
        return hashlib.sha256(bearer_token(key_header(request)).encode()).hexdigest()

    async def read_body(self, request: Request) -> bytes:
        """The request's body, declared JSON (check_json_body) and bounded by max_body_bytes."""
        check_json_body(request.headers.get("content-type"))
        limit = self.settings.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None:
            if not (length.isascii() and length.isdigit()) or len(length) > 19:
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
        except ClientDisconnect:  # one line (the app's handler), not a server error's traceback
            why = _CLOSED_BY.get(request.scope.get(CLOSED_BY), "the client disconnected")
            of = f" of {length}" if length is not None else ""
            raise ClientGone(f"{why} after {size}{of} body bytes") from None
        return b"".join(chunks)

    async def parse(self, request: Request, model, known: set[str] = KNOWN_FIELDS):
        """The request's body validated as `model`, and the gRPC metadata of its key; a 400
        names the field at fault, one of `known` (the body's field names)."""
        metadata = self.authorize(request)
        body = await self.read_body(request)
        try:
            # off the event loop: a body's checks may compile up to MAX_TOOLS tool schemas
            # (router/openai/protocol.py), which must not stall every other connection
            return await asyncio.to_thread(model.model_validate_json, body), metadata
        except ValidationError as e:
            raise validation_error(e, known) from None
        except RecursionError:  # a check that recursed past Python's limit on a nested value
            raise ApiError(
                400, "the body is nested too deeply: flatten its values", code="invalid_body"
            ) from None

    def check_prompt_size(self, texts: list[str], param: str) -> None:
        s = self.settings
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

    def check_request_size(self, message, param: str | None = None) -> None:
        """Refuses (413, naming `param`) a gRPC request to the router larger than its port
        takes: gRPC would refuse it as RESOURCE_EXHAUSTED, which no retry passes."""
        limit = self.max_request_bytes
        if limit and (size := message.ByteSize()) > limit:
            raise request_too_large(
                f"it is {size} bytes as a gRPC message, more than the {limit} the router takes",
                param,
            )

    def check_model(self, model: str | None) -> None:
        """A body's `model`, when set, must be the served one or one of its LoRA adapters."""
        served = self.settings.model_id
        loras = self.settings.loras
        if model is not None and loras is not None and loras.adapter_for(model) is not None:
            return
        if model is not None and model != served:
            raise ApiError(
                404,
                f"model {model[:200]!r} is not served here: use {served!r} (or leave model unset)",
                param="model",
                code="model_not_found",
            )

    async def encode(self, param: str, fn, *args):
        """fn(*args) of the prompt encoder, on the encoder's own threads: neither on the event
        loop nor on the default executor's, which parse every request's body (an encoder call
        waits for the router's one tokenizer thread). At most MAX_ENCODER_CALLS run or wait at
        once: past that a 429, since /tokenize and count_tokens go through no admission."""
        future = self._encoding.submit(fn, *args)
        if future is None:
            raise ApiError(
                429,
                f"{MAX_ENCODER_CALLS} tokenizer calls are running or waiting, the most at once: "
                "retry later",
                "rate_limit_error",
                param=param,
                code="rate_limit_exceeded",
            )
        try:
            return await asyncio.wrap_future(future)
        except BadRequest as e:
            status = _ENCODER_STATUS.get(e.code, 400)
            raise ApiError(status, f"{param}: {e.message}", param=param) from None


# the HTTP status of a prompt encoder's refusal (router/text.py BadRequest) other than a 400: the
# router stopping, and its tokenizer's queue full (both with Retry-After)
_ENCODER_STATUS = {grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.RESOURCE_EXHAUSTED: 429}


class BoundedPool:
    """A thread pool that takes at most `limit` calls at once, running or queued: `submit` gives
    None past that instead of queueing without bound. A call's slot is freed when it ends, or
    when it is cancelled before it ran."""

    def __init__(self, threads: int, limit: int, name: str):
        self._pool = futures.ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._slots = threading.BoundedSemaphore(limit)

    def submit(self, fn, *args) -> futures.Future | None:
        if not self._slots.acquire(blocking=False):
            return None
        try:
            future = self._pool.submit(fn, *args)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        return future


def check_json_body(content_type: str | None) -> None:
    """Refuses (415) a body whose Content-Type is not JSON's: application/json (with a charset
    parameter or without) or a `+json` type; vLLM too takes application/json alone, which the
    openai and anthropic SDKs and `curl -H 'Content-Type: application/json'` send. A body sent as
    text/plain, as a form, or with no Content-Type is what a web page may POST to another origin
    without the browser's CORS preflight; refused, no page the operator opens can make a front
    without API keys (on loopback, say) generate."""
    media = (content_type or "").partition(";")[0].strip().lower()
    kind, slash, subtype = media.partition("/")
    if media == "application/json" or (kind and slash and subtype.endswith("+json")):
        return
    got = f"got {content_type[:100]!r}" if content_type is not None else "none was sent"
    raise ApiError(
        415,
        f"the body must be JSON with the header 'Content-Type: application/json' ({got})",
        code="unsupported_media_type",
    )


def state_of(request: Request) -> FrontState:
    return request.app.state.front


def key_header(request: Request) -> str | None:
    """The request's `Authorization` value, or Anthropic's x-api-key header as one."""
    header = request.headers.get("authorization")
    if header is None and (key := request.headers.get("x-api-key")) is not None:
        header = f"Bearer {key}"  # Anthropic's clients send their key so
    return header
