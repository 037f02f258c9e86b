"""The OpenAI-compatible HTTP front's server (the app is router/openai/app.py's build_app): its
settings, the listening socket, and uvicorn on a thread of its own with its own event loop, so no
gRPC thread ever waits on HTTP; Router.stop() stops it first (open streams are cancelled after
the grace period).

The handlers call the router's gRPC API through an in-process grpc.aio channel to a Unix socket in
a private (0700) directory that the gRPC server also listens on (add_internal_port): the loopback
path needs neither the client port's TLS nor a client certificate, and no TCP port is opened for
it. With TLS, the certificate files uvicorn reads are written to that directory and deleted as
soon as they are loaded. The channel keeps each call's flow-control window small
(INTERNAL_WINDOW_BYTES): a stream the event loop has not read holds its router thread (the
front's calls step on the router's thread pool: router/service.py), whose leg then joins the
tokens that queue meanwhile into one delta (router/decode_streams.py).

Every connection is bounded (router/openai/connections.py): `header_timeout_s` to send its request
headers, `body_timeout_s` between two pieces of its body, and at most `max_connections` open at
once (0: derived from the process's file descriptor limit, leaving the rest to gRPC and the
workers' channels); the error lines of a flood of bad clients are rate-limited while it serves.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import grpc.aio
import uvicorn

from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc
from pdserve.protos.security import NO_KEYS, ClientKeys, TLSConfig
from pdserve.router.openai.app import build_app
from pdserve.router.openai.connections import (
    LISTEN_BACKLOG,
    ConnectionBook,
    Limits,
    RateLimitFilter,
    accept_batch,
    connection_cap,
    fd_limit,
    install_filter,
    protocol_class,
    remove_filter,
    sweep,
)

log = logging.getLogger(__name__)
# The internal channel's window per call, for data the event loop has not read: room for a few
# dozen token deltas. gRPC widens it for a larger message while that message is being read.
INTERNAL_WINDOW_BYTES = 1024
_INTERNAL_CHANNEL_OPTIONS = (
    ("grpc.http2.lookahead_bytes", INTERNAL_WINDOW_BYTES),
    ("grpc.http2.bdp_probe", 0),  # else gRPC grows the window to the socket's bandwidth
)


def default_max_body_bytes(max_model_len: int, max_prompt_bytes: int) -> int:
    """The largest body a valid request can have, at least 4 MiB: a prompt of max_prompt_bytes
    written as JSON escapes (at most 6 bytes per UTF-8 byte: `\\u00e9`), or max_model_len token
    ids of 11 characters each, a chat's prediction as long as a prompt, plus a MiB for the other
    fields at their caps."""
    return max(4 << 20, 12 * max_prompt_bytes + 12 * max_model_len + (1 << 20))


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
    # the router's PromptEncoder (router/text.py): /tokenize counts what Generate runs; None:
    # one of the front's own on `tokenizer`
    encoder: object = None
    metrics_registry: object = None
    metrics_keys: ClientKeys = NO_KEYS  # any: GET /metrics takes one of these, no client key
    # the router's LoRA adapters (router/lora.py RouterAdapters): `model` names and the run-time
    # load/unload endpoints; None: none (a front built without the router's)
    loras: object = None
    # the router's pause (router/pause.py RouterPause): /pause, /resume, /is_paused; None: none
    pause: object = None
    # the router's weight updates (router/weights.py RouterWeights); None: none
    weights: object = None
    # the router's sleep mode (router/sleep.py RouterSleep): /sleep, /wake_up, /is_sleeping;
    # None: none
    sleep: object = None
    # the prefix-cache reset across both pools (router/cache_reset.py): /reset_prefix_cache,
    # /flush_cache
    cache_reset: object = None
    on_error: Callable[[int], None] = lambda status: None  # each error response's HTTP status
    ready: Callable[[], str | None] = lambda: None  # None: serving; else why not
    grace_s: float = 1.0
    # a connection must send its request headers within this (from its accept, or from the end
    # of its previous response), else it is closed (408 if it sent part of them)
    header_timeout_s: float = 10.0
    # the longest pause in a request body (and in reading a response) before the connection is
    # closed (408 while the body is read)
    body_timeout_s: float = 30.0
    # open connections at most; at the cap a new one closes the one that waited longest for its
    # client. 0: the soft RLIMIT_NOFILE less max(1024, a quarter) kept for gRPC and the workers
    max_connections: int = 0
    log_interval_s: float = 10.0  # a flood's error lines: one of a kind per this long
    # the Files API's files on the router's disk, inputs and batch outputs, at most
    # (router/openai/files_api.py); 0: no Files or Batch API
    files_store_bytes: int = 1 << 30
    # where they are kept across router restarts, with the batches (router.files_dir); None: a
    # temporary folder removed when the front stops
    files_dir: str | None = None
    # lines of all batches running at once, at most (router/openai/batches_api.py)
    batch_max_inflight: int = 16
    # /v1/responses' stored responses at most (router/openai/responses/store.py); 0: none kept
    responses_store_bytes: int = 64 << 20
    # the classification head's labels (router/openai/scoring.py): empty, the model has none and
    # /v1/score and /v1/rerank compare embeddings
    labels: tuple[str, ...] = ()
    # a model with labels whose deployment gives a chat_template: each scoring pair is rendered
    # by it as a "query" then a "document" message (vLLM's score template), not joined as text
    score_template: bool = False
    # without a template: each pair is the tokenizer's pair encoding of the two texts (a BERT-like
    # tokenizer's separators, a Llama one's second BOS), else the two texts joined as one; the
    # model's config.json use_pad_token, as vLLM decides (router/server.py)
    pair_encoding: bool = False
    # the origins whose web pages may call the API (CORS: router/openai/app.py), "*" any; empty,
    # none: no browser page can read an answer or send a body
    cors_allowed_origins: tuple[str, ...] = ()
    # the hosts (and the hosts under them) whose image links a chat may send, which the front
    # fetches (router/openai/media.py); (): no link is fetched
    allowed_media_domains: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("header_timeout_s", "body_timeout_s", "log_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HttpSettings.{name} must be > 0, got {getattr(self, name)}")
        if self.max_connections < 0:
            raise ValueError(
                f"HttpSettings.max_connections must be >= 0 (0: derived), got "
                f"{self.max_connections}"
            )


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
        self.book: ConnectionBook | None = None  # the open connections, once started
        self._limits: Limits | None = None
        self._log_filter: RateLimitFilter | None = None

    def add_internal_port(self, grpc_server: grpc.Server) -> None:
        """The Unix socket the HTTP handlers call gRPC through; before grpc_server.start()."""
        grpc_server.add_insecure_port(self.grpc_target)

    def start(self, timeout_s: float = 30.0) -> HttpFront:
        """Binds the socket, starts uvicorn on its thread and waits until it serves; raises
        OSError (the front stopped again) if it does not within `timeout_s`."""
        limit = fd_limit()
        derived = connection_cap(limit)
        self._bound_connections(limit, derived)
        sock = _bind(self.settings.host, self.settings.port)
        try:
            config = self._config(accept_batch(limit, derived))
            config.load()  # reads the TLS files now; they are deleted right after
        except BaseException:
            sock.close()
            raise
        finally:
            self._remove_tls_files()
        self._server = uvicorn.Server(config)
        self._log_filter = RateLimitFilter(self.settings.log_interval_s)
        install_filter(self._log_filter)
        port = sock.getsockname()[1]
        host = self.settings.host
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._thread = threading.Thread(
            target=self._run, args=(sock,), name="router-http", daemon=True
        )
        self._thread.start()
        self._wait_started(timeout_s)
        sock.listen(LISTEN_BACKLOG)  # asyncio listened with its accept batch (accept_batch)
        return self

    def _bound_connections(self, limit: int, derived: int) -> None:
        """The connection cap (the settings' or the one derived from the fd `limit`), the
        connections' time limits and their book."""
        s = self.settings
        cap = s.max_connections or derived
        if cap > derived:
            log.warning(
                "HTTP: max_connections=%d leaves less than %d of the %d file descriptors this "
                "process may open to gRPC and the workers",
                cap,
                limit - derived,
                limit,
            )
        self._limits = Limits(
            s.header_timeout_s,
            s.body_timeout_s,
            handshake_timeout_s=s.header_timeout_s,
            log_interval_s=s.log_interval_s,
            max_body_bytes=s.max_body_bytes,
        )
        self.book = ConnectionBook(cap, self._limits.handshake_timeout_s)

    def _config(self, backlog: int) -> uvicorn.Config:
        return uvicorn.Config(
            build_app(self),
            log_config=None,  # the process's logging stays as it is
            access_log=False,
            http=protocol_class(self.book, self._limits),
            backlog=backlog,
            ws="none",
            lifespan="off",
            loop="asyncio",
            server_header=False,
            timeout_graceful_shutdown=max(1, math.ceil(self.settings.grace_s)),
            **self._ssl_options(),
        )

    def _wait_started(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise OSError(
                    f"the HTTP front did not start on {self.address}: {self._error or 'timeout'}"
                )
            time.sleep(0.01)

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

    def connection_stats(self) -> dict:
        """The open connections, the cap, and how many were evicted, refused or timed out."""
        return self.book.stats() if self.book is not None else {}

    def _run(self, sock: socket.socket) -> None:
        async def serve():
            if self.settings.tls is not None:
                # a TLS handshake is bounded like request headers (asyncio's default: 60 s)
                loop = asyncio.get_running_loop()
                loop.create_server = functools.partial(
                    loop.create_server, ssl_handshake_timeout=self.settings.header_timeout_s
                )
            channel = grpc.aio.insecure_channel(self.grpc_target, _INTERNAL_CHANNEL_OPTIONS)
            self.stub = pdserve_pb2_grpc.PDServeStub(channel)
            sweeper = asyncio.create_task(sweep(self.book, self._limits))
            # the batches a router before this one left in router.files_dir go on
            await self._server.config.app.state.front.batches.resume(bool(self.settings.keys))
            try:
                await self._server.serve(sockets=[sock])
            finally:
                sweeper.cancel()
                front = self._server.config.app.state.front
                await front.responses.stop()
                await front.batches.stop()
                front.files.close()
                for conn in list(self.book.open):  # those still open after the grace period
                    if conn.transport is not None:
                        conn.transport.abort()
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
        if self._log_filter is not None:
            remove_filter(self._log_filter)
            self._log_filter = None
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
