"""The router process: worker pool + PDServe service + Registry + Admin (role flips, and the
reconciler that holds every worker to its intended role: router/reconcile.py) + health +
reflection on one gRPC server.

    router = Router(RouterConfig(model=model_dir, prefill_addresses=[p.address],
                                 decode_addresses=[d.address])).start()
    # or with no addresses: workers join through pdserve.worker.v1.Registry at router.address
    stub = pdserve_pb2_grpc.PDServeStub(grpc.insecure_channel(router.address))
    ...
    router.stop()
"""

from __future__ import annotations

import gc
import logging
import os
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from pdserve.engine.loader import load_hf_config, resolve_model
from pdserve.engine.loader.generation_config import (
    OVERRIDE_NOTICE,
    check_mode,
    check_override,
    default_sampling_params,
    describe,
)
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.planner.live import PlannerLoop
from pdserve.planner.local_prefill import LocalPrefill
from pdserve.planner.policy import PlannerConfig
from pdserve.protos import keepalive, tracing
from pdserve.protos.limits import MAX_IMAGES, MAX_REQUEST_IMAGE_BYTES, MAX_STREAM_INTERVAL
from pdserve.protos.media_domains import check_media_domain
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.protos.security import INSECURE, ClientKeys, ClusterSecurity, TLSConfig
from pdserve.router.cache_reset import RouterCacheReset
from pdserve.router.capture import TraceCapture
from pdserve.router.console import ConsoleStats
from pdserve.router.flips import AdminServicer, Flips
from pdserve.router.grpc_loop import LoopServer
from pdserve.router.lora import RouterAdapters
from pdserve.router.metrics import RouterMetrics
from pdserve.router.peer_fetch import PeerFetch
from pdserve.router.planner_actuator import RouterActuator
from pdserve.router.pool import CHANNEL_OPTIONS, WorkerPool
from pdserve.router.reconcile import Reconciler
from pdserve.router.registry import RegistryServicer
from pdserve.router.service import PDServeServicer, ServiceOptions
from pdserve.router.sleep import RouterSleep
from pdserve.router.weights import RouterWeights

if TYPE_CHECKING:
    from pdserve.router.openai.server import HttpFront

log = logging.getLogger(__name__)
SERVICE_NAME = pdserve_pb2.DESCRIPTOR.services_by_name["PDServe"].full_name
REGISTRY_NAME = worker_pb2.DESCRIPTOR.services_by_name["Registry"].full_name
# Abort, ListModels and the Registry still get a thread when Generate calls take every other one:
# at most max_inflight running (a gRPC client's between its blocking steps holds none, the HTTP
# front's holds one throughout) and max_queued waiting to be admitted (router/admission.py)
_EXTRA_THREADS = 8
# The calls one client connection may hold open at once: twice what admission lets run and wait,
# so that a client's calls past admission still meet its RESOURCE_EXHAUSTED rather than a queue
# in the client, plus room for Aborts, health, reflection and the workers' Registry streams. A
# stranger's calls that send headers and never a body then cost at most this many coroutines a
# connection; past it, the client's HTTP/2 stack waits for a call of its own to end.
_STREAMS_HEADROOM = 256


def streams_per_connection(max_inflight: int, max_queued: int) -> int:
    return 2 * (max_inflight + max_queued) + _STREAMS_HEADROOM


@dataclass(frozen=True)
class RouterConfig:
    model: str  # what the workers serve: HF directory, *.gguf or "smollm2"
    # the sampling defaults of a request that leaves a field unset (vLLM's --generation-config,
    # engine/loader/generation_config.py): "auto", the model's generation_config.json; "vllm",
    # none (vLLM's neutral ones); a folder path, its generation_config.json. The workers' engines
    # read the same file's end-of-sequence ids (their EngineConfig.generation_config)
    generation_config: str = "auto"
    # vLLM's --override-generation-config: sampling defaults laid over the generation config's
    # ((field, value) pairs of generation_config.json's names: check_override)
    override_generation_config: tuple = ()
    # the Jinja chat template chats are rendered with instead of the tokenizer's (vLLM's
    # --chat-template; deploy/config/files.py reads and parses it)
    chat_template: str | None = None
    prefill_addresses: tuple = ()  # static workers; empty: wait for workers to Register
    decode_addresses: tuple = ()
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    max_inflight: int = 64  # concurrent Generate calls; more wait to be admitted
    # past max_inflight, calls wait in a FIFO queue (router/admission.py): at most max_queued of
    # them (more get RESOURCE_EXHAUSTED, HTTP 429), each for at most max_queue_wait_s (then
    # UNAVAILABLE, HTTP 503)
    max_queued: int = 1024
    max_queue_wait_s: float = 60.0
    # "fcfs" (a request's priority must be 0) or "priority" (vLLM's: lower first in every queue
    # of its path); embeddings' pooling ("last" or "mean") and L2 normalisation
    scheduling_policy: str = "fcfs"
    embedding_pooling: str = "last"
    embedding_normalize: bool = True
    # a generative model's label tokens (the workers' classifier_from_token): its classification
    # head's labels for /v1/score, /v1/rerank and /classify (engine/score_head.py)
    classifier_from_token: tuple = ()
    # a Matryoshka embedding model (embeddings' `dimensions`): True, or the dimensions allowed;
    # None: as its config.json says (is_matryoshka, matryoshka_dimensions), vLLM's keys
    matryoshka: bool | tuple | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # a reservation's shortest lease: each is asked for until its client's deadline (cut to the
    # decode worker's max_lease_ms) and renewed by every KV frame (decode_worker/handoff.py)
    lease_ms: int = 10_000
    model_id: str | None = None  # ModelCard.id; None: the model's directory or file name
    # other names requests may give for the base model (vLLM's several --served-model-name);
    # ListModels has a card for each, answers name the model as the request did
    model_aliases: tuple[str, ...] = ()
    dtype: str | None = None  # ModelCard.dtype; None: config.json's torch_dtype
    stop_grace_s: float = 1.0
    stats_interval_s: float = 0.5  # how often every worker's Stats is polled
    # a console line per pool every this many seconds (router/console.py); 0: none
    console_stats_interval_s: float = 0.0
    # every finished request appended to this file as a line of a replayable trace
    # (router/capture.py), rotated past capture_max_bytes; None: no capture
    capture_trace: str | None = None
    capture_max_bytes: int = 256 << 20
    # OpenTelemetry: spans to this OTLP endpoint (else $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; None
    # and unset: off), sampled at this ratio of new traces (protos/tracing.py); trace_exporter:
    # an OpenTelemetry SpanExporter instead of the endpoint (tests)
    otlp_traces_endpoint: str | None = None
    trace_sample_ratio: float = 1.0
    trace_exporter: object | None = field(default=None, repr=False)
    # worker health (router/pool.py): silent (no Stats answer, no heartbeat) worker_down_s, it
    # gets no new work (down) until it answers; silent worker_silence_s, it is dead and its calls
    # resume elsewhere. An engine stuck in one loop turn for max(worker_stall_s,
    # worker_stall_factor x its longest recent turn) is dead too, though its server answers.
    worker_down_s: float = 2.0
    worker_silence_s: float = 4.0
    worker_stall_s: float = 5.0
    worker_stall_factor: float = 4.0
    heartbeat_ms: int = 1000  # registered workers heartbeat this often, drop out after 3 missed
    max_resumes: int = 2  # decode workers one request may move to when its worker dies
    # a role flip's drain bound: the flipped worker's calls still open then move (router/flips.py)
    flip_drain_s: float = 5.0
    # a worker not brought to its intended role and state within this long is skipped for new
    # work and logged as an error; the router keeps driving it (router/reconcile.py)
    reconcile_bound_s: float = 10.0
    decode_queue_timeout_s: float = 120.0  # longest wait for decode KV blocks when all are full
    # vLLM's and SGLang's --stream-interval: decode workers send a stream's tokens in groups of
    # this many, its first and its end at once (1: each as it comes; ReserveRequest's field)
    stream_interval: int = 1
    colocated: bool = False  # decode workers prefill too: no prefill pool, no hand-off
    # disaggregated: prompts their decode worker runs itself (planner/local_prefill.py); off
    local_prefill: LocalPrefill = field(default_factory=LocalPrefill)
    # disaggregated: a turn's prefill worker pulls the cached prefix its decode worker holds,
    # when estimated faster than recomputing it (router/peer_fetch.py)
    peer_fetch: PeerFetch = field(default_factory=PeerFetch)
    # moves the split while traffic shifts (planner/live.py); None: the static split
    planner: PlannerConfig | None = None
    # the deployment's cluster secret and mutual TLS: the Registry and every call to a worker use
    # it (the client API stays open); INSECURE: no check (in-process setups, tests)
    security: ClusterSecurity = field(default=INSECURE)
    deployment_id: str = ""  # set: workers registering for another deployment are refused
    # TLS on the client-facing port (cert_pem/key_pem; with ca_pem, clients must present a cert)
    client_tls: TLSConfig | None = None
    # the OpenAI-compatible HTTP front (router/openai/app.py) on host:http_port, with the client
    # port's TLS (client_tls, else security.tls) as HTTPS; 0: a free port; None: no HTTP front
    http_port: int | None = None
    http_max_body_bytes: int | None = None  # None: the largest valid request (openai/server.py)
    # the HTTP front's bounds on a client (router/openai/connections.py): seconds to send the
    # request headers and between two body pieces; open connections (0: derived from the fd limit)
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 30.0
    http_max_connections: int = 0
    # /v1/responses' stored responses in the HTTP front, at most (0: none kept)
    http_responses_store_bytes: int = 64 << 20
    # the Files API's files on the router's disk at most (0: no Files or Batch API), and the
    # Batch API's lines running at once (router/openai/files_api.py, batches_api.py)
    http_files_store_bytes: int = 1 << 30
    http_files_dir: str | None = None  # router.files_dir: kept across restarts; None: temporary
    http_batch_max_inflight: int = 16
    # the origins whose web pages may call the HTTP front (CORS, router/openai/app.py); "*" any;
    # empty: none
    http_cors_allowed_origins: tuple[str, ...] = ()
    # the hosts whose image links the HTTP front fetches (router/openai/media.py); (): none
    http_allowed_media_domains: tuple[str, ...] = ()
    # the images one prompt may hold (router.limit_mm_per_prompt; router/images.py)
    max_images: int = MAX_IMAGES
    # more arguments of the processor's call for a chat's images (router.mm_processor_kwargs)
    mm_processor_kwargs: dict = field(default_factory=dict)
    # client API keys: when any, the client API (gRPC metadata or HTTP header
    # `authorization: Bearer <key>`) refuses calls without one of them; never shown or logged
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # the metrics scrape's own keys: when any, GET /metrics takes one of them and no client key
    metrics_keys: tuple[str, ...] = field(default=(), repr=False)
    # LoRA adapters (router/lora.py): on or off, the deployment's {name: path} (held as pairs:
    # the workers load them from their own config), and the run-time load/unload endpoints
    lora_enabled: bool = False
    lora_modules: tuple = ()
    lora_allow_runtime_updates: bool = False
    # POST /pause, POST /resume, GET /is_paused (router/pause.py): off, 404
    pause_endpoints: bool = False
    # POST /update_weights_from_disk (router/weights.py): off, 404
    weight_updates: bool = False
    # POST /sleep, POST /wake_up, GET /is_sleeping (router/sleep.py): off, 404
    sleep_mode: bool = False

    def __post_init__(self):
        for name in (
            "stats_interval_s",
            "worker_down_s",
            "decode_queue_timeout_s",
            "worker_stall_s",
            "flip_drain_s",
            "reconcile_bound_s",
            "max_queue_wait_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"RouterConfig.{name} must be > 0, got {getattr(self, name)}")
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(
                f"RouterConfig.stream_interval must be 1 to {MAX_STREAM_INTERVAL} tokens, got "
                f"{self.stream_interval}"
            )
        if not 0 <= self.console_stats_interval_s < float("inf"):
            raise ValueError(
                f"RouterConfig.console_stats_interval_s must be >= 0 (0: no console line), got "
                f"{self.console_stats_interval_s}"
            )
        if not 0 <= self.trace_sample_ratio <= 1:
            raise ValueError(
                f"RouterConfig.trace_sample_ratio must be within [0, 1], got "
                f"{self.trace_sample_ratio}"
            )
        for name in ("capture_max_bytes", "heartbeat_ms", "max_inflight"):
            if getattr(self, name) < 1:
                raise ValueError(f"RouterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.worker_down_s > self.worker_silence_s:
            raise ValueError(
                f"RouterConfig.worker_down_s ({self.worker_down_s:g}) must not exceed "
                f"worker_silence_s ({self.worker_silence_s:g}): a worker is skipped for new work "
                f"before it is declared dead"
            )
        beat_s = max(self.heartbeat_ms / 1000, self.stats_interval_s)
        if self.worker_silence_s < 2 * beat_s:
            raise ValueError(
                f"RouterConfig.worker_silence_s ({self.worker_silence_s:g}) must be at least "
                f"twice the heartbeat period and the Stats interval ({beat_s:g} s): a worker "
                f"that answers on time would look silent"
            )
        if self.worker_stall_factor < 1:
            raise ValueError(
                f"RouterConfig.worker_stall_factor must be >= 1, got {self.worker_stall_factor}"
            )
        for name in ("max_resumes", "max_queued"):
            if getattr(self, name) < 0:
                raise ValueError(f"RouterConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"RouterConfig.scheduling_policy must be 'fcfs' or 'priority', got "
                f"{self.scheduling_policy!r}"
            )
        if self.embedding_pooling not in ("last", "mean"):
            raise ValueError(
                f"RouterConfig.embedding_pooling must be 'last' or 'mean', got "
                f"{self.embedding_pooling!r}"
            )
        if self.lease_ms <= 0:
            raise ValueError(f"RouterConfig.lease_ms must be > 0, got {self.lease_ms}")
        self._check_front_and_model()

    def _check_front_and_model(self) -> None:
        """The HTTP front's, the keys' and the model's settings (__post_init__'s last checks)."""
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(
                f"RouterConfig.http_port must be None or 0..65535, got {self.http_port}"
            )
        if self.http_max_body_bytes is not None and self.http_max_body_bytes < 1024:
            raise ValueError(
                f"RouterConfig.http_max_body_bytes must be None or >= 1024, got "
                f"{self.http_max_body_bytes}"
            )
        ClientKeys(tuple(self.api_keys))  # raises on a malformed key, without showing it
        ClientKeys(tuple(self.metrics_keys))
        check_mode(self.generation_config, "RouterConfig.generation_config")
        check_override(
            dict(self.override_generation_config), "RouterConfig.override_generation_config"
        )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(
                f"RouterConfig.max_model_len must be None or >= 2, got {self.max_model_len}"
            )


def max_request_bytes(max_model_len: int, max_prompt_bytes: int) -> int:
    """The largest request a valid client can send, at least gRPC's usual 4 MiB: a prompt of
    max_model_len ids (varints of at most 5 bytes) or max_prompt_bytes of text or chat, twice over,
    a prediction's text as long as a prompt's, and a MiB for the sampling lists at their caps (the
    65,536 allowed and 65,536 predicted ids among them) and the framing. A larger message is
    refused by gRPC itself (RESOURCE_EXHAUSTED, with both sizes) before it is read whole or
    parsed, so a huge prompt costs the router almost nothing."""
    return max(4 << 20, 3 * max_prompt_bytes + 10 * max_model_len + (1 << 20))


# RouterConfig's fields that ServiceOptions takes as they are
PASSED_TO_SERVICE = (
    "max_images",
    "mm_processor_kwargs",
    "max_inflight",
    "max_queued",
    "max_queue_wait_s",
    "scheduling_policy",
    "embedding_pooling",
    "embedding_normalize",
    "lease_ms",
    "max_resumes",
    "decode_queue_timeout_s",
    "stream_interval",
    "colocated",
    "local_prefill",
    "peer_fetch",
)


def service_options(config: RouterConfig, model_dir) -> ServiceOptions:
    hf = load_hf_config(model_dir)
    hf_text = hf.get("text_config", hf)
    max_len = config.max_model_len or hf_text.get("max_position_embeddings")
    if not max_len:
        raise ValueError(
            f"{model_dir}/config.json has no max_position_embeddings: set "
            f"RouterConfig.max_model_len"
        )
    dtype = config.dtype or hf_text.get("torch_dtype") or hf_text.get("dtype") or "float32"
    model_id = (
        config.model_id or os.path.basename(os.fspath(config.model).rstrip("/")) or str(model_dir)
    )
    labels, generates = class_labels(hf, tuple(config.classifier_from_token))
    matryoshka = config.matryoshka
    if matryoshka is None:
        dims = hf_text.get("matryoshka_dimensions")
        matryoshka = tuple(dims) if dims else bool(hf_text.get("is_matryoshka"))
    return ServiceOptions(
        model_id=model_id,
        model_root=os.fspath(config.model),
        max_model_len=int(max_len),
        vocab_size=int(hf_text.get("vocab_size", 0)),
        dtype=str(dtype),
        labels=labels,
        generates=generates,
        pair_encoding=bool(hf_text.get("use_pad_token", hf.get("use_pad_token", True))),
        matryoshka=matryoshka,
        hidden_size=int(hf_text.get("hidden_size", 0)),
        image_token_id=image_token_id(hf),
        model_dir=os.fspath(model_dir),
        sampling_defaults=tuple(
            default_sampling_params(
                model_dir, config.generation_config, dict(config.override_generation_config)
            ).items()
        ),
        **{name: getattr(config, name) for name in PASSED_TO_SERVICE},
    )


def image_token_id(hf: dict) -> int | None:
    """A vision-language checkpoint's image token (as engine/config.py reads it), whose chats
    may hold images; None for any other model."""
    from pdserve.engine.image_keys import MULTIMODAL_ARCHITECTURES

    if (hf.get("architectures") or [""])[0] not in MULTIMODAL_ARCHITECTURES:
        return None
    found = hf.get("image_token_id", hf.get("image_token_index"))
    return None if found is None else int(found)


def class_labels(hf: dict, from_token: tuple) -> tuple[tuple[str, ...], bool]:
    """(the classification head's labels, whether the model generates), from config.json as
    the engine reads it (engine/config.py ModelConfig.from_hf): a *ForSequenceClassification
    checkpoint's id2label names (it does not generate), else the label tokens named."""
    arch = (hf.get("architectures") or [""])[0]
    if not arch.endswith("ForSequenceClassification"):
        return from_token, True
    n = int(hf.get("num_labels") or len(hf.get("id2label") or {}) or 2)
    names = hf.get("id2label") or {}
    return tuple(str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(n)), False


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.pool: WorkerPool | None = None
        self.servicer: PDServeServicer | None = None
        self.flips: Flips | None = None  # role flips (router/flips.py), once started
        # each worker's intended role and state, and the thread that drives it there
        self.reconciler: Reconciler | None = None
        self.planner: PlannerLoop | None = None  # when config.planner is set
        self._server: LoopServer | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self._prefill_executor: futures.ThreadPoolExecutor | None = None
        self._health: health.aio.HealthServicer | None = None
        self.address: str | None = None
        self.http: HttpFront | None = None  # the OpenAI-compatible HTTP front, when http_port set
        self.http_address: str | None = None
        # every Prometheus figure of the cluster: GET /metrics on the HTTP front renders it
        self.metrics_registry = CollectorRegistry(auto_describe=True)
        self.metrics: RouterMetrics | None = None  # router/metrics.py, on metrics_registry
        self.console: ConsoleStats | None = None  # router/console.py
        self.tracing = None  # protos/tracing.py Tracing (None: off)

    def start(self) -> Router:
        from pdserve.router.openai.connections import raise_fd_limit

        cfg = self.config
        raise_fd_limit()  # soft RLIMIT_NOFILE to the hard limit: HTTP and gRPC clients, workers
        try:
            model_dir = resolve_model(cfg.model)
            options = service_options(cfg, model_dir)
            tokenizer = load_tokenizer(model_dir)
            if cfg.chat_template is not None:  # vLLM's --chat-template: over the tokenizer's
                tokenizer.chat_template = cfg.chat_template
            self._start_service(options, tokenizer)
            self._start_recording()
            self._server = self._grpc_server(options)
            pdserve_pb2_grpc.add_PDServeServicer_to_server(self.servicer, self._server)
            self.reconciler = Reconciler(
                self.pool,
                self.servicer.legs.open,
                bound_s=cfg.reconcile_bound_s,
                drain_s=cfg.flip_drain_s,
                registry=self.metrics_registry,
                model_name=options.model_id,
            ).start()
            self.flips = Flips(
                self.pool,
                self.servicer.legs.open,
                drain_s=cfg.flip_drain_s,
                registry=self.metrics_registry,
                model_name=options.model_id,
                reconciler=self.reconciler,
            )
            worker_pb2_grpc.add_AdminServicer_to_server(AdminServicer(self.flips), self._server)
            if cfg.planner is not None and not cfg.colocated:
                self.planner = PlannerLoop(
                    cfg.planner,
                    RouterActuator(self.pool, self.flips, self.servicer.legs, self.metrics.recent),
                    registry=self.metrics_registry,
                    model_name=options.model_id,
                )
            self._add_registry_and_health(options)
            port = self._bind(f"{cfg.host}:{cfg.port}")
            if port == 0:
                raise OSError(f"cannot listen on {cfg.host}:{cfg.port}: set port to a free one")
            self.address = f"{cfg.host}:{port}"
            if cfg.http_port is not None:
                self.http = self._http_front(options)
                self.http.add_internal_port(self._server)
            self._server.start()
            if self.http is not None:
                self.http_address = self.http.start().address
        except BaseException:
            self.stop()
            raise
        for name in ("", SERVICE_NAME, REGISTRY_NAME):
            self._server.run(self._health.set(name, health_pb2.HealthCheckResponse.SERVING))
        if self.planner is not None:
            self.planner.start()
        if cfg.console_stats_interval_s > 0:
            self.console = ConsoleStats(
                self.pool, self.metrics_registry, options.model_id, cfg.console_stats_interval_s
            ).start()
        # The startup heap (imports, tokenizer, templates) lives as long as the process; frozen,
        # the cyclic GC stops walking it, so a full collection under a flood of connections does
        # not hold the GIL over it and stall every thread. stop() unfreezes it, for a process
        # that runs several routers (tests).
        gc.collect()
        gc.freeze()
        log.info(
            "router serving %s on %s%s (prefill %s, decode %s, more may register)",
            options.model_id,
            self.address,
            f" and HTTP on {self.http.scheme}://{self.http_address}" if self.http else "",
            list(cfg.prefill_addresses),
            list(cfg.decode_addresses),
        )
        log.info("%s", self._formats_line())
        self._log_sampling_defaults(options)
        return self

    def _log_sampling_defaults(self, options: ServiceOptions) -> None:
        """Which default sampling the router took from the model's generation config (vLLM
        warns the same way), or that it took none."""
        defaults = dict(options.sampling_defaults)
        mode = self.config.generation_config
        if self.config.override_generation_config:
            mode = f"{mode}, override_generation_config"
        if defaults:
            log.warning(
                "%s Taken from generation_config=%r: %s", OVERRIDE_NOTICE, mode, describe(defaults)
            )
        else:
            log.info("default sampling parameters: none from generation_config=%r", mode)

    def _formats_line(self) -> str:
        """What the router read from the model's tokenizer and template (no parser flags): its
        tool call format, whether it reasons in <think> tags, its fill-in-the-middle tokens."""
        from pdserve.router.openai.fim import fim_format

        service = self.servicer
        fim = fim_format(service.tokenizer)
        return (
            f"model formats: tool calls {service.tool_format}; reasoning "
            f"{'in <think> tags' if service.reasoning_tags else 'none'}; fill-in-the-middle "
            f"{fim.family if fim else 'none'}"
        )

    def _start_recording(self) -> None:
        """The request spans (protos/tracing.py) and the traffic capture (router/capture.py),
        before the first request can arrive; each off unless configured."""
        cfg = self.config
        self.servicer.tracing = self.tracing = tracing.setup(
            "pdserve-router",
            cfg.otlp_traces_endpoint,
            cfg.trace_sample_ratio,
            exporter=cfg.trace_exporter,
        )
        self.servicer.legs.tracing = self.tracing  # each Prefill call's span
        if cfg.capture_trace is not None:
            self.servicer.capture = TraceCapture(cfg.capture_trace, cfg.capture_max_bytes)

    def _start_service(self, options: ServiceOptions, tokenizer) -> None:
        """The worker pool (started), the metrics on the router's registry, and the PDServe
        service with the thread pool its prefill legs run on."""
        cfg = self.config
        self.pool = WorkerPool(
            list(cfg.prefill_addresses),
            list(cfg.decode_addresses),
            stats_ttl_s=cfg.stats_interval_s,
            down_s=cfg.worker_down_s,
            silence_s=cfg.worker_silence_s,
            security=cfg.security,
            stall_s=cfg.worker_stall_s,
            stall_factor=cfg.worker_stall_factor,
        ).start()
        self._prefill_executor = futures.ThreadPoolExecutor(
            cfg.max_inflight, thread_name_prefix="router-prefill"
        )
        self.metrics = RouterMetrics(
            self.metrics_registry,
            self.pool,
            options.model_id,
            options.max_model_len,
            colocated=cfg.colocated,
        )
        self.servicer = PDServeServicer(
            self.pool, tokenizer, options, self._prefill_executor, metrics=self.metrics
        )
        self.servicer.loras = RouterAdapters(
            options.model_id,
            cfg.lora_enabled,
            cfg.lora_modules,
            cfg.lora_allow_runtime_updates,
            pool=self.pool,
            aliases=cfg.model_aliases,
        )
        self.servicer.pause.enabled = cfg.pause_endpoints
        self.servicer.tenants_by_key = bool(cfg.api_keys)
        self.servicer.weights = RouterWeights(self.pool, cfg.weight_updates)
        self.servicer.sleep = RouterSleep(self.pool, self.servicer.pause, cfg.sleep_mode)
        admission = self.servicer.admission
        self.metrics.track_router(
            self.servicer.num_inflight,
            self.servicer.legs.decode_queue.waiting,
            lambda: float(admission.is_paused),
            admission.tenants_waiting,
        )

    def _grpc_server(self, options: ServiceOptions) -> LoopServer:
        """The gRPC server (not yet bound or started) on its event loop, with the thread pool
        its blocking work runs on, and its interceptors."""
        cfg = self.config
        self._executor = futures.ThreadPoolExecutor(
            cfg.max_inflight + cfg.max_queued + _EXTRA_THREADS, thread_name_prefix="router-grpc"
        )
        self.servicer.executor = self._executor
        # the client API (given API keys: with one of them) and reflection need no secret;
        # the Registry does
        guard = cfg.security.server_interceptors(
            open_prefixes=(f"/{SERVICE_NAME}/", "/grpc.reflection."),
            client_keys=ClientKeys(tuple(cfg.api_keys)),
            keyed_prefixes=(f"/{SERVICE_NAME}/",),
            aio=True,
        )
        limit = max_request_bytes(options.max_model_len, self.servicer.encoder.max_prompt_bytes)
        if options.image_token_id is not None:  # a chat's image files (pdserve.v1.ContentPart)
            limit += MAX_REQUEST_IMAGE_BYTES
        return LoopServer(
            self._executor,
            guard,
            [
                *[o for o in CHANNEL_OPTIONS if o[0] != "grpc.max_receive_message_length"],
                ("grpc.max_receive_message_length", limit),
                (
                    "grpc.max_concurrent_streams",
                    streams_per_connection(cfg.max_inflight, cfg.max_queued),
                ),
                *keepalive.SERVER_OPTIONS,  # the workers' registration channels ping
            ],
        )

    def _add_registry_and_health(self, options: ServiceOptions) -> None:
        """The workers' Registry, gRPC health and reflection, on the server."""
        cfg = self.config
        worker_pb2_grpc.add_RegistryServicer_to_server(
            RegistryServicer(
                self.pool,
                options.model_id,
                heartbeat_ms=cfg.heartbeat_ms,
                deployment_id=cfg.deployment_id,
            ),
            self._server,
        )
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer(
                (SERVICE_NAME, REGISTRY_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
            ),
            self._server,
        )

    def _http_front(self, options: ServiceOptions):
        from pdserve.router.openai.server import (
            HttpFront,
            HttpSettings,
            default_max_body_bytes,
        )

        cfg = self.config
        return HttpFront(
            HttpSettings(
                host=cfg.host,
                port=cfg.http_port,
                model_id=options.model_id,
                tokenizer=self.servicer.tokenizer,
                encoder=self.servicer.encoder,
                keys=ClientKeys(tuple(cfg.api_keys)),
                # the gRPC client port's TLS (_bind): router.tls, else the cluster's mutual TLS
                tls=cfg.client_tls if cfg.client_tls is not None else cfg.security.tls,
                max_body_bytes=cfg.http_max_body_bytes
                or default_max_body_bytes(
                    options.max_model_len, self.servicer.encoder.max_prompt_bytes
                )
                # a chat's image files, as base64 data URLs
                + (0 if options.image_token_id is None else 4 * MAX_REQUEST_IMAGE_BYTES // 3),
                max_model_len=options.max_model_len,
                max_prompt_bytes=self.servicer.encoder.max_prompt_bytes,
                header_timeout_s=cfg.http_header_timeout_s,
                body_timeout_s=cfg.http_body_timeout_s,
                max_connections=cfg.http_max_connections,
                responses_store_bytes=cfg.http_responses_store_bytes,
                files_store_bytes=cfg.http_files_store_bytes,
                files_dir=cfg.http_files_dir,
                batch_max_inflight=cfg.http_batch_max_inflight,
                cors_allowed_origins=tuple(cfg.http_cors_allowed_origins),
                allowed_media_domains=tuple(
                    check_media_domain(d) for d in cfg.http_allowed_media_domains
                ),
                labels=options.labels,
                score_template=bool(options.labels) and cfg.chat_template is not None,
                pair_encoding=options.pair_encoding,
                metrics_registry=self.metrics_registry,
                metrics_keys=ClientKeys(tuple(cfg.metrics_keys)),
                loras=self.servicer.loras,
                pause=self.servicer.pause,
                weights=self.servicer.weights,
                sleep=self.servicer.sleep,
                cache_reset=RouterCacheReset(self.pool),
                on_error=self.metrics.observe_http_error,
                ready=self._not_ready,
                grace_s=cfg.stop_grace_s,
            )
        )

    def _not_ready(self) -> str | None:
        """None while every pool the router needs has a worker; else why not (GET /health)."""
        pool = self.pool
        if pool is None:
            return "the router is stopping"
        roles = ("decode",) if self.config.colocated else ("prefill", "decode")
        empty = [r for r in roles if not pool.num_workers(r)]
        return f"no {' or '.join(empty)} worker in the pool" if empty else None

    def _bind(self, address: str) -> int:
        """The client-facing port: TLS when client_tls is set, else mutual TLS when the cluster
        uses it (workers and clients then share the CA), else plaintext."""
        tls = self.config.client_tls
        if tls is not None:
            creds = grpc.ssl_server_credentials(
                [(tls.key_pem, tls.cert_pem)],
                root_certificates=tls.ca_pem or None,
                require_client_auth=bool(tls.ca_pem),
            )
            return self._server.add_secure_port(address, creds)
        return self.config.security.add_port(self._server, address)

    def stop(self) -> None:
        """Stops taking requests, cancels open streams (which aborts them on the workers), then
        closes the worker channels. The HTTP front goes first: its open streams are cancelled,
        which cancels their gRPC calls."""
        gc.unfreeze()
        if self.console is not None:
            self.console.stop()
            self.console = None
        if self.planner is not None:  # no flip may start while the rest stops
            self.planner.stop()
            self.planner = None
        if self.http is not None:
            self.http.stop()
            self.http = None
        if self._health is not None and self._server is not None:
            self._server.run(self._health.enter_graceful_shutdown())
        if self._server is not None:
            self._server.stop(grace=self.config.stop_grace_s).wait(self.config.stop_grace_s + 5)
            self._server = None
        if self.servicer is not None:
            self.servicer.close()
            if self.servicer.capture is not None:  # what finished before the stop is written
                self.servicer.capture.close()
                self.servicer.capture = None
        if self.tracing is not None:  # the spans of the calls that ended go out
            self.tracing.close()
            self.tracing = None
        for name in ("_executor", "_prefill_executor"):  # grpc does not own them
            executor = getattr(self, name)
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)
                setattr(self, name, None)
        if self.reconciler is not None:  # before the pool: it calls the pool's workers
            self.reconciler.stop()
            self.reconciler = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
