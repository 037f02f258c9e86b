"""Who may call a pdserve process, and how its gRPC doors are opened.

Every process of a deployment (router, workers, KV channels) builds one ClusterSecurity from the
deployment's config at its start and keeps it for its lifetime: the cluster secret that every
control-plane call carries, and optional mutual TLS between the processes. Servers install
ServerGuard (`server_interceptors()`), which refuses a call without the secret, or without a
client API key where the deployment sets keys (ClientKeys), before any handler runs; it also
turns a request that protobuf cannot parse into INVALID_ARGUMENT. The client API (PDServe), the
standard health service and reflection need no secret. The secret and the keys never appear in
a repr, a log line or an error message.
"""

from __future__ import annotations

import hmac
import inspect
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import grpc
import grpc.aio

log = logging.getLogger(__name__)
SECRET_METADATA_KEY = "x-pdserve-cluster-secret"
# services a stranger may call without the secret: the health service (load balancers, probes)
# and, on the router, the client API with its reflection
HEALTH_PREFIX = "/grpc.health.v1.Health/"
MIN_SECRET_CHARS = 16
API_KEY_METADATA_KEY = "authorization"  # gRPC metadata keys are lower case; HTTP's header name
MIN_API_KEY_CHARS = 8
MAX_API_KEY_CHARS = 512
# On a grpc.server (not grpc.aio), how many handler threads may wait at once for the request of a
# call to a method that needs no secret (health): a stranger who sends a call's headers and never
# its message holds such a thread until OPEN_WAIT_S have passed, when the call is cancelled
MAX_OPEN_WAITS = 4
OPEN_WAIT_S = 5.0  # a probe sends its request with its headers; nobody honest waits this long


class _OpenWaits:
    """The calls whose threads wait for their request (_bounded_wait), each cancelled once it
    has waited OPEN_WAIT_S: one daemon thread per process watches them all (at most
    MAX_OPEN_WAITS a server), from the first wait until none is left."""

    def __init__(self):
        self._cond = threading.Condition()
        self._waits: dict[int, tuple[float, grpc.ServicerContext]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None

    def add(self, context) -> int:
        with self._cond:
            self._next += 1
            self._waits[self._next] = (time.monotonic() + OPEN_WAIT_S, context)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="pdserve-open-waits", daemon=True
                )
                self._thread.start()
            self._cond.notify()
            return self._next

    def remove(self, token: int) -> None:
        with self._cond:
            self._waits.pop(token, None)

    def _watch(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [t for t, (end, _) in self._waits.items() if end <= now]
                overdue = [self._waits.pop(t)[1] for t in due]
                if not self._waits and not overdue:
                    self._thread = None
                    return
                if not overdue:
                    self._cond.wait(min(end for end, _ in self._waits.values()) - now)
                    continue
            for context in overdue:  # ends the wait: the request iterator raises
                context.cancel()


_OPEN_WAITS = _OpenWaits()


@dataclass(frozen=True)
class TLSConfig:
    """Mutual TLS material, as PEM bytes (read once where the config is loaded, so it travels to
    workers on other nodes with the rest of their config)."""

    ca_pem: bytes = field(repr=False)
    cert_pem: bytes = field(repr=False)
    key_pem: bytes = field(repr=False)
    # the name the peers' certificates are issued for, when it is not the host in the address
    server_name: str = ""

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem, private_key=self.key_pem, certificate_chain=self.cert_pem
        )


def client_key_metadata() -> tuple[tuple[str, str], ...]:
    """The gRPC metadata a pdserve client command sends: the key in PDSERVE_API_KEY, if any."""
    key = os.environ.get("PDSERVE_API_KEY", "")
    return ((API_KEY_METADATA_KEY, f"Bearer {key}"),) if key else ()


def bearer_token(value: str | bytes | None) -> str | bytes | None:
    """The credential of an `Authorization: Bearer <key>` value (the scheme in any case), or None
    when `value` is not one."""
    if value is None:
        return None
    sep = b" " if isinstance(value, bytes) else " "
    scheme, _, token = value.strip().partition(sep)
    if scheme.lower() not in ("bearer", b"bearer") or not token.strip():
        return None
    return token.strip()


def check_api_key(key: str, where: str = "an API key") -> str:
    """A client API key as configured: printable ASCII without spaces or commas (it travels in an
    HTTP header and gRPC metadata, and PDSERVE_API_KEYS separates keys with commas), 8 to 512
    characters. The message never shows the key."""
    if not isinstance(key, str):
        raise ValueError(f"{where} must be a string")
    if not MIN_API_KEY_CHARS <= len(key) <= MAX_API_KEY_CHARS:
        raise ValueError(
            f"{where} must have {MIN_API_KEY_CHARS} to {MAX_API_KEY_CHARS} characters, has "
            f"{len(key)}"
        )
    if any(not (0x21 <= ord(c) <= 0x7E) or c == "," for c in key):
        raise ValueError(f"{where} must be printable ASCII without spaces or commas")
    return key


def _is_one_of(presented: str | bytes | None, candidates) -> bool:
    """Whether `presented` equals one of `candidates` (bytes): every one is compared, each in
    constant time, whatever matches first."""
    if presented is None:
        return False
    if isinstance(presented, str):
        presented = presented.encode("utf-8", "surrogatepass")
    ok = False
    for candidate in candidates:
        ok |= hmac.compare_digest(presented, candidate)
    return ok


@dataclass(frozen=True)
class ClientKeys:
    """The API keys clients may present (any one of them); empty: the client API is open.

    With keys set, the client API (the methods under `keyed_prefixes`; on the router,
    pdserve.v1.PDServe) needs one of them in the `authorization` metadata entry as `Bearer <key>`
    (the HTTP front's header, the same words); a call without a valid one ends with
    UNAUTHENTICATED before any handler runs. Health and reflection stay open."""

    keys: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self):
        for i, key in enumerate(self.keys):
            check_api_key(key, f"API key #{i + 1}")
        object.__setattr__(self, "_encoded", tuple(k.encode() for k in self.keys))

    def __repr__(self) -> str:
        return f"ClientKeys({len(self.keys)} key{'' if len(self.keys) == 1 else 's'})"

    def __bool__(self) -> bool:
        return bool(self.keys)

    def accepts(self, presented: str | bytes | None) -> bool:
        """Whether `presented` (the key itself) is one of the keys (always True without keys).
        Every key is compared, each in constant time, whatever matches first."""
        return not self.keys or _is_one_of(presented, self._encoded)

    def accepts_header(self, authorization: str | bytes | None) -> bool:
        """Whether an `Authorization` value (`Bearer <key>`) carries one of the keys."""
        return self.accepts(bearer_token(authorization)) if self.keys else True


NO_KEYS = ClientKeys()


@dataclass(frozen=True)
class ClusterSecurity:
    """secret: the deployment's cluster secret. Every control-plane call (Registry, DecodeWorker,
    PrefillWorker, the KV channels) carries it in the `x-pdserve-cluster-secret` metadata entry.
    None: no check (a library user's in-process setup; `pdserve up` always sets one).
    tls: optional mutual TLS between the processes of the deployment: PEM bytes of the CA that
    signed every process's certificate, and this process's certificate and key. Channels and
    ports then use it in place of plaintext."""

    secret: str | None = field(default=None, repr=False)
    tls: TLSConfig | None = None

    def __post_init__(self):
        if self.secret is not None and len(self.secret) < MIN_SECRET_CHARS:
            raise ValueError(
                f"the cluster secret must have at least {MIN_SECRET_CHARS} characters "
                f"(got {len(self.secret)}); leave it unset and pdserve up makes one"
            )

    def __repr__(self) -> str:
        return (
            f"ClusterSecurity(secret={'<set>' if self.secret else None}, "
            f"tls={'mutual' if self.tls else None})"
        )

    # ---- servers --------------------------------------------------------------------------------
    def server_interceptors(
        self,
        open_prefixes: tuple[str, ...] = (),
        client_keys: ClientKeys = NO_KEYS,
        keyed_prefixes: tuple[str, ...] = (),
        aio: bool = False,
        max_open_waits: int = MAX_OPEN_WAITS,
    ) -> list:
        """For grpc.server(interceptors=...) (`aio`: grpc.aio.server's): methods under
        `open_prefixes` (and health) need no secret; of those, the ones under `keyed_prefixes`
        need one of `client_keys` when there are any; every method decodes its request
        safely. On a grpc.server, at most `max_open_waits` handler threads wait at once for the
        request of a call to an open method (ServerGuard says why); keep it well below the
        server's thread count."""
        guard = ServerGuard(
            self.secret,
            (HEALTH_PREFIX,) + tuple(open_prefixes),
            client_keys,
            tuple(keyed_prefixes),
            max_open_waits,
        )
        return [AioServerGuard(guard) if aio else guard]

    def add_port(self, server: grpc.Server, address: str) -> int:
        """Binds `address` with mutual TLS when configured; returns the port (0: not bound)."""
        if self.tls is not None:
            return server.add_secure_port(address, self.tls.server_credentials())
        return server.add_insecure_port(address)

    # ---- clients --------------------------------------------------------------------------------
    def channel(self, address: str, options=()) -> grpc.Channel:
        """A channel to another process of the deployment, carrying the secret on every call."""
        options = list(options)
        if self.tls is not None:
            if self.tls.server_name:
                options.append(("grpc.ssl_target_name_override", self.tls.server_name))
            raw = grpc.secure_channel(address, self.tls.channel_credentials(), options=options)
        else:
            raw = grpc.insecure_channel(address, options=options)
        if not self.secret:
            return raw
        return _SecretChannel(raw, self.secret)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((SECRET_METADATA_KEY, self.secret),) if self.secret else ()

    def accepts(self, presented: str | bytes | None) -> bool:
        """Whether `presented` is the secret (always True without one); constant time."""
        return not self.secret or _is_one_of(presented, [self.secret.encode()])


INSECURE = ClusterSecurity()


class _Undecodable:
    """What the guard's deserializer returns for bytes protobuf cannot parse."""

    def __init__(self, error: Exception):
        self.error = error


def _safe_deserializer(deserialize):
    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, UnicodeDecodeError, ...
            return _Undecodable(e)

    return parse


def _keep_mode(behavior, wrapper):
    """`wrapper`, marked as `behavior` is for grpc.server: a behavior marked
    experimental_non_blocking (the health service's Watch) gets a send_response_callback and
    returns at once instead of holding its thread for the whole call; a wrapper that dropped the
    mark would pin a thread per Watch."""
    for name in ("experimental_non_blocking", "experimental_thread_pool"):
        if hasattr(behavior, name):
            setattr(wrapper, name, getattr(behavior, name))
    return wrapper


def _reject_undecodable(behavior, method: str):
    if inspect.iscoroutinefunction(behavior):  # a grpc.aio handler
        return _reject_undecodable_async(behavior, method)

    def check(request, context, *callback):
        if isinstance(request, _Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable(method, request))
        return behavior(request, context, *callback)

    return _keep_mode(behavior, check)


def _undecodable(method: str, request: _Undecodable) -> str:
    return (
        f"{method}: the request is not a valid protobuf message ({request.error}); "
        f"string fields must be UTF-8"
    )


def _reject_undecodable_async(behavior, method: str):
    async def check(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable(method, request))
        return await behavior(request, context)

    return check


def _decoded_stream(handler: grpc.RpcMethodHandler, method: str, aio: bool):
    """A request-streaming `handler` whose messages are decoded safely: the first one protobuf
    cannot parse ends the call with INVALID_ARGUMENT, as on a unary method (gRPC's own
    deserializer ends it INTERNAL). The reader aborts: on a grpc.server a handler that reads on
    a thread of its own (DecodeWorker.Streams) sees its read fail, and the call ends with that
    status once the handler returns. A grpc.aio handler that is not a coroutine is left as it
    is."""
    behavior = handler.stream_unary or handler.stream_stream
    make = (
        grpc.stream_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.stream_unary_rpc_method_handler
    )
    if aio:
        serve = _decoded_stream_async(behavior, method)
        if serve is None:
            return handler
    else:

        def decoded(requests, context):
            for request in requests:
                if isinstance(request, _Undecodable):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable(method, request))
                yield request

        def serve(requests, context, *callback):
            return behavior(decoded(requests, context), context, *callback)

        _keep_mode(behavior, serve)
    return make(
        serve,
        request_deserializer=_safe_deserializer(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )


def _decoded_stream_async(behavior, method: str):
    """_decoded_stream's behavior on grpc.aio (None for a handler that is not a coroutine)."""

    async def decoded(requests, context):
        async for request in requests:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable(method, request))
            yield request

    if inspect.isasyncgenfunction(behavior):

        async def serve_stream(requests, context):
            async for response in behavior(decoded(requests, context), context):
                yield response

        return serve_stream
    if inspect.iscoroutinefunction(behavior):

        async def serve(requests, context):
            return await behavior(decoded(requests, context), context)

        return serve
    return None


def _refusal(
    handler: grpc.RpcMethodHandler,
    message: str,
    aio: bool = False,
    code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED,
) -> grpc.RpcMethodHandler:
    """A handler that ends the call with `code` at once, without reading its request. It is
    request-streaming whatever the method's request is: grpc.server runs a unary-request handler
    only once the whole message arrived, holding a pool thread until then, so a caller that
    sends a call's headers and never its message would hold one thread per call, and enough such
    calls would take every thread (a stranger, without the secret). A request-streaming handler
    runs at once; on grpc.aio it runs on the event loop."""
    if aio:

        async def refuse(requests, context):
            await context.abort(code, message)

        async def refuse_stream(requests, context):
            await context.abort(code, message)
            yield  # pragma: no cover - abort raises

    else:

        def refuse(requests, context):
            context.abort(code, message)

        def refuse_stream(requests, context):
            context.abort(code, message)
            yield  # pragma: no cover - abort raises

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    return grpc.stream_unary_rpc_method_handler(refuse)


def _bounded_wait(handler: grpc.RpcMethodHandler, method: str, slots: threading.Semaphore, limit):
    """A unary-request `handler` of an open method (health) on grpc.server, served as
    request-streaming: its thread waits for the one request message holding one of `slots`
    (`limit` in all), and a call that finds none free ends RESOURCE_EXHAUSTED at once; a call
    whose request has not come within OPEN_WAIT_S is cancelled. So strangers who never send
    their message hold at most `limit` threads, each for OPEN_WAIT_S, and every other method
    keeps the rest; the open method itself may be refused while they hold them."""
    behavior = handler.unary_unary or handler.unary_stream
    make = (
        grpc.stream_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.stream_unary_rpc_method_handler
    )

    def request_of(requests, context):
        if not slots.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{method}: {limit} calls to this server's open methods are already waiting for "
                f"their request; retry",
            )
        token = _OPEN_WAITS.add(context)
        try:
            request = next(requests, None)
        finally:
            _OPEN_WAITS.remove(token)
            slots.release()
        if request is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method} takes one request message")
        if isinstance(request, _Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable(method, request))
        return request

    def serve(requests, context, *callback):
        return behavior(request_of(requests, context), context, *callback)

    return make(
        _keep_mode(behavior, serve),
        request_deserializer=_safe_deserializer(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )


class ServerGuard(grpc.ServerInterceptor):
    """Runs on gRPC's polling thread for every call: a dictionary lookup and a constant-time
    compare, nothing that can block. It also decodes requests itself: a message protobuf cannot
    parse (truncated bytes, non-UTF-8 in a string field) ends with INVALID_ARGUMENT naming the
    method, instead of gRPC's INTERNAL "Exception deserializing request!", on request-streaming
    methods too.

    Nothing a caller without the secret sends holds a handler thread: a refusal reads no request
    (_refusal), and on grpc.server at most `max_open_waits` threads wait for the request of a
    call to an open method (_bounded_wait; on grpc.aio such a wait holds no thread)."""

    LOG_EVERY_S = 10.0  # refusals are logged at most this often (a stranger may call in a loop)

    def __init__(
        self,
        secret: str | None,
        open_prefixes: tuple[str, ...],
        client_keys: ClientKeys = NO_KEYS,
        keyed_prefixes: tuple[str, ...] = (),
        max_open_waits: int = MAX_OPEN_WAITS,
    ):
        self._security = ClusterSecurity(secret)
        self._open = open_prefixes
        self._keys = client_keys
        self._keyed = keyed_prefixes
        self._max_open_waits = max(1, max_open_waits)
        self._open_waits = threading.Semaphore(self._max_open_waits)
        self._lock = threading.Lock()
        self._refused_since_log = 0
        self._logged_at = -float("inf")

    def _note_refusal(
        self, method: str, presented: str | None, what: str = "cluster secret"
    ) -> None:
        with self._lock:
            self._refused_since_log += 1
            now = time.monotonic()
            if now - self._logged_at < self.LOG_EVERY_S:
                return
            count, self._refused_since_log, self._logged_at = self._refused_since_log, 0, now
        log.warning(
            "refused %s: %s %s (%d refusal%s since the last such line)",
            method,
            "no" if presented is None else "a wrong",
            what,
            count,
            "" if count == 1 else "s",
        )

    def _key_refusal(
        self, handler, method: str, metadata, aio: bool
    ) -> grpc.RpcMethodHandler | None:
        """None when the call carries one of the client keys; else the handler that refuses it."""
        presented = None
        for key, value in metadata or ():
            if key == API_KEY_METADATA_KEY:
                presented = value
                break
        if self._keys.accepts_header(presented):
            return None
        self._note_refusal(method, presented, "API key")
        return _refusal(
            handler,
            f"{method} needs an API key: send the metadata entry "
            f"'{API_KEY_METADATA_KEY}: Bearer <key>' with one of the deployment's keys",
            aio,
        )

    def intercept_service(self, continuation, handler_call_details):
        return self.guard(continuation(handler_call_details), handler_call_details)

    def guard(self, handler, handler_call_details, aio: bool = False):
        """The handler that serves the call: `handler`, refusing or decoding safely (`aio`: on
        a grpc.aio server)."""
        if handler is None:
            return None
        method = handler_call_details.method or ""
        metadata = handler_call_details.invocation_metadata
        if self._keys and self._keyed and method.startswith(self._keyed):
            refused = self._key_refusal(handler, method, metadata, aio)
            if refused is not None:
                return refused
        is_open = method.startswith(self._open)
        if self._security.secret and not is_open:
            presented = None
            for key, value in metadata or ():
                if key == SECRET_METADATA_KEY:
                    presented = value
                    break
            if not self._security.accepts(presented):
                self._note_refusal(method, presented)
                return _refusal(
                    handler,
                    f"{method} is part of the pdserve control plane and needs "
                    f"the deployment's cluster secret in the "
                    f"{SECRET_METADATA_KEY!r} metadata entry",
                    aio,
                )
        if handler.request_deserializer is None:
            return handler
        if handler.request_streaming:
            return _decoded_stream(handler, method, aio)
        if is_open and not aio:
            return _bounded_wait(handler, method, self._open_waits, self._max_open_waits)
        behavior = handler.unary_unary or handler.unary_stream
        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return make(
            _reject_undecodable(behavior, method),
            request_deserializer=_safe_deserializer(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )


class AioServerGuard(grpc.aio.ServerInterceptor):
    """ServerGuard for a grpc.aio server: the same checks, on its event loop."""

    def __init__(self, guard: ServerGuard):
        self._guard = guard

    async def intercept_service(self, continuation, handler_call_details):
        return self._guard.guard(
            await continuation(handler_call_details), handler_call_details, aio=True
        )


def _secret_method(kind: str):
    """_SecretChannel's `kind` (unary_unary, ...): the plain channel's, adding the secret."""

    def method(self, method, request_serializer=None, response_deserializer=None, **kw):
        call = getattr(self._raw, kind)(method, request_serializer, response_deserializer, **kw)
        return _WithSecret(call, self._entry)

    method.__name__ = kind
    return method


class _SecretChannel(grpc.Channel):
    """A channel that adds the cluster secret to every call's metadata. Not grpc's
    intercept_channel: an intercepted channel registers a method with the channel at the
    method's first call, not when the stub is made, and grpc (1.85) registers on a closed channel
    without checking, so a first call after (or during) close() crashed the process (a segfault
    in a CI run: the router's stop beside an Abort; grpc/grpc#43455). Here each method is
    registered when its stub is made, as on a plain channel, and a call after close() raises
    ValueError as grpc's own channel does."""

    def __init__(self, raw: grpc.Channel, secret: str):
        self._raw = raw
        self._entry = (SECRET_METADATA_KEY, secret)

    unary_unary = _secret_method("unary_unary")
    unary_stream = _secret_method("unary_stream")
    stream_unary = _secret_method("stream_unary")
    stream_stream = _secret_method("stream_stream")

    def subscribe(self, callback, try_to_connect=False):
        self._raw.subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback):
        self._raw.unsubscribe(callback)

    def close(self):
        self._raw.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self.close()
        return False


class _WithSecret:
    """One method of a _SecretChannel: the plain channel's multicallable, with the secret added to
    the metadata of each call (`__call__`, and `with_call` and `future` where the kind has them)."""

    __slots__ = ("_call", "_entry")

    def __init__(self, call, entry: tuple[str, str]):
        self._call, self._entry = call, entry

    def _metadata(self, metadata) -> tuple:
        return (*metadata, self._entry) if metadata else (self._entry,)

    def __call__(self, request, timeout=None, metadata=None, **kw):
        return self._call(request, timeout=timeout, metadata=self._metadata(metadata), **kw)

    def with_call(self, request, timeout=None, metadata=None, **kw):
        return self._call.with_call(
            request, timeout=timeout, metadata=self._metadata(metadata), **kw
        )

    def future(self, request, timeout=None, metadata=None, **kw):
        return self._call.future(request, timeout=timeout, metadata=self._metadata(metadata), **kw)
