"""The frame every worker process shares: its common settings, the engine built on its loop
thread, its role parts, the gRPC server, pool registration, and the order things stop in.

A worker is made of parts, one per role it can serve (prefill_worker/server.py's PrefillPart,
decode_worker/server.py's DecodePart), around one engine. PrefillWorker and DecodeWorker have one
part each; the launcher builds every deployed worker with both (`WorkerProcess(config, parts,
role)`), so that it can switch roles while it runs (worker_common/role.py). `start()` builds and
warms the engine on its loop thread, starts each part, serves every part's gRPC service (and
WorkerControl, with two parts) and joins the router's pool under its current role; the worker
serves until `stop()`, which leaves the pool, closes the gRPC server, closes the parts and then
stops the engine.

    worker = DecodeWorker(DecodeWorkerConfig(model=model_dir)).start()
    stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(worker.address))
    ...
    worker.stop()
"""

from __future__ import annotations

import ctypes
import gc
import logging
from dataclasses import dataclass, field
from typing import Protocol, Self

import grpc

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.engine.engine_loop import EngineLoop, warmed
from pdserve.protos.limits import MAX_PIXEL_VALUE_BYTES
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.protos.security import INSECURE, ClusterSecurity
from pdserve.worker_common.grpc_server import ServiceHost
from pdserve.worker_common.registration import Registration, register_worker
from pdserve.worker_common.role import ControlServicer, RoleGate

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 << 20  # long prompts' token id lists
# How often the engine loop gives freed heap back (release_freed_heap). tune_malloc lets glibc
# keep up to 256 MiB of freed heap for the KV frames' sake; without a trim a worker's RSS floats
# by the size of its last big transient (a long prefill's activations) and hides any growth.
HEAP_TRIM_PERIOD_S = 10.0
# How often the engine loop reports the KV blocks its tier lost on its own (a failed disk write,
# engine/block_manager.py reap_tier) while no allocation does: about a router's Stats poll period,
# so an idle worker's block index entries do not outlive its blocks for long.
REAP_TIER_PERIOD_S = 1.0


def release_freed_heap() -> bool:
    """Gives the heap memory that is free back to the system (glibc's malloc_trim; False where
    there is none). Called once, after the engine is built and warmed: building and warming it
    free much of what they allocate on the way (about 0.7 GB in the example deployment's
    prefill worker, 1 GB in its decode worker), and glibc would keep that until a later free
    happened to trim it, minutes into serving: the worker's RSS would drop by that much mid-run,
    a step that hides any growth. The engine loop calls it again every HEAP_TRIM_PERIOD_S, between
    steps, for what serving frees."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def engine_ticks(loop) -> None:
    """A worker's periodic work on its engine loop's thread, between steps and while idle: the
    freed heap given back (release_freed_heap), and the KV blocks the engine's tier lost on its
    own (a failed disk write) reported "removed" (engine/block_manager.py reap_tier), so the
    router's block index forgets them even while no allocation runs."""
    loop.every(HEAP_TRIM_PERIOD_S, release_freed_heap)
    block_manager = getattr(loop.engine, "block_manager", None)
    if getattr(block_manager, "tier", None) is not None:
        loop.every(REAP_TIER_PERIOD_S, block_manager.reap_tier)


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker process takes; PrefillWorkerConfig and DecodeWorkerConfig add theirs."""

    model: str
    engine_kwargs: dict = field(default_factory=dict)  # LLM(model, **engine_kwargs)
    # the id it registers under, which must be the router's (deploy: served_model_id); None:
    # the model string's base name, as the router's default
    model_id: str | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    worker_id: str = "worker-0"
    # gRPC handler threads; None: 2 x the engine's max_num_seqs + 16 (each worker says why)
    max_workers: int | None = None
    stop_grace_s: float = 1.0
    registry_address: str = ""  # a router's address: join its pool (worker_common/registration.py)
    # every RPC to this worker (and, decode, its KV channels) needs security.secret; the
    # router's Registry too. INSECURE: no check (in-process setups and tests)
    security: ClusterSecurity = field(default=INSECURE)
    deployment_id: str = ""  # sent with Register; the router refuses another deployment's workers
    # OpenTelemetry (protos/tracing.py): this worker's spans to this OTLP endpoint (else
    # $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; None and unset: off); trace_exporter: a SpanExporter
    # instead (tests)
    # this process's own log lines (its log file, where Ray points its stderr): the pdserve
    # loggers' level and format (pdserve/logs.py; the deployment's observability keys)
    log_level: str = "info"
    log_format: str = "text"
    otlp_traces_endpoint: str | None = None
    trace_sample_ratio: float = 1.0
    trace_exporter: object | None = field(default=None, repr=False)


class Part(Protocol):
    """One role of a worker (PrefillPart, DecodePart): what it adds to the engine and the server.
    `prepare` runs before the engine is built, `start` after (the worker's loop, config and gate
    are set), `close` after the gRPC server stopped."""

    role: str  # "prefill" | "decode"
    service_name: str  # its gRPC service, marked SERVING in the health service

    def prepare(self) -> None: ...
    # a shared-file KV pool's folder, given the engine's tensor-parallel size (under pipeline
    # stages only the first stage's ranks use it: the later stages push their own KV), or None
    def shared_dir(self, tp_size: int) -> str | None: ...
    # optional: engine settings the part adds (PrefillPart: the pipeline stages' KV sender)
    # engine_extras(self, worker: WorkerProcess) -> dict
    def start(self, worker: WorkerProcess, engine: LLMEngine) -> None: ...
    def add_to(self, server: grpc.Server) -> None: ...
    def stats(self) -> worker_pb2.WorkerStats: ...
    def remaining(self) -> str: ...  # its work beyond the engine's (reservations), in words
    def close(self) -> None: ...


class WorkerProcess:
    """A worker of `parts`, serving `role` (the first part's role by default). A single-role
    worker subclasses it and writes `_parts` from its config:

        class DecodeWorker(WorkerProcess):
            def _parts(self):
                return [DecodePart.from_config(self.config)]

    `start` and `stop` do the rest, in the order the module docstring gives.
    """

    def __init__(self, config: WorkerConfig, parts: list[Part] | None = None, role: str = ""):
        self.config = config
        self.parts = {p.role: p for p in (parts if parts is not None else self._parts())}
        if role and role not in self.parts:
            raise ValueError(f"role {role!r} is not one of this worker's {list(self.parts)}")
        self.gate = RoleGate(config.worker_id, role or next(iter(self.parts)), tuple(self.parts))
        self.loop: EngineLoop | None = None
        self._host: ServiceHost | None = None
        self.address: str | None = None
        self.registration: Registration | None = None

    def _parts(self) -> list[Part]:
        raise NotImplementedError("give parts, or subclass and write _parts")

    @property
    def role(self) -> str:
        return self.gate.role

    @property
    def tp_size(self) -> int:
        return self.config.engine_kwargs.get("tensor_parallel_size", 1)

    def start(self) -> Self:
        """Builds and serves the worker; on any failure stops what had started, then raises."""
        try:
            parts = list(self.parts.values())
            for part in parts:
                part.prepare()
            shared = [d for d in (p.shared_dir(self.tp_size) for p in parts) if d]
            engine = self._build_engine(shared[0] if shared else None)
            for part in parts:
                part.start(self, engine)
            self._serve()
        except BaseException:
            self.stop()
            raise
        # The startup heap (torch, transformers, the model's modules, the tokenizer) lives as
        # long as the worker: frozen, the cyclic GC stops walking it, whose full passes every few
        # hundred decode steps otherwise stall the loop thread's step (the measurement:
        # docs/experiments/engine-decode-step.md). stop() unfreezes it, for a process that runs
        # several workers (tests).
        gc.collect()
        gc.freeze()
        log.info(
            "%s worker %s serving on %s%s",
            self.role,
            self.config.worker_id,
            self.address,
            f" (can switch to {', '.join(r for r in self.parts if r != self.role)})"
            if len(self.parts) > 1
            else "",
        )
        return self

    def stop(self) -> None:
        """Registration and the gRPC server first (open streams end), then the parts, then the
        engine loop."""
        gc.unfreeze()
        self._stop_serving()
        for part in self.parts.values():
            try:
                part.close()
            except Exception:  # the others and the engine must still stop
                log.exception("closing the %s part of %s failed", part.role, self.config.worker_id)
        self._stop_engine()

    def stats(self) -> worker_pb2.WorkerStats:
        """The current role's WorkerStats (with the role and its state: the services' Stats
        stamp them, RoleGate.stamp)."""
        return self.parts[self.gate.role].stats()

    def remaining(self, role: str) -> str:
        """The work of `role` still in the worker, in words ("" when none). While the worker
        drains a role it admits no other, so the engine's requests are all that role's."""
        load = self.loop.load()
        left = [f"{load[k]} {k[4:]} sequence(s)" for k in ("num_running", "num_waiting") if load[k]]
        own = self.parts[role].remaining()
        return ", ".join(left + ([own] if own else []))

    def unhealthy(self) -> str:
        """Why the worker must not be given work ("" when it may), from each part that can say
        (its Stats fails UNAVAILABLE meanwhile, so the router takes it down)."""
        reasons = []
        for part in self.parts.values():
            ask = getattr(part, "unhealthy", None)  # parts that hold nothing have none
            if ask is not None and (why := ask()):
                reasons.append(why)
        return "; ".join(reasons)

    def _build_engine(self, shared_dir: str | None = None) -> LLMEngine:
        """The engine itself, not an LLM (an LLM shuts its engine down when collected), built and
        warmed on the loop thread that will step it (EngineLoop.build says why). shared_dir: put
        the KV pool in a shared file there (where another process or rank must map it), unless
        engine_kwargs already name a kv_cache_shared_dir."""
        cfg = self.config
        engine_kwargs = dict(cfg.engine_kwargs)
        if shared_dir and not engine_kwargs.get("kv_cache_shared_dir"):
            engine_kwargs["kv_cache_shared_dir"] = shared_dir
        for part in self.parts.values():
            extras = getattr(part, "engine_extras", None)
            if extras is not None:
                engine_kwargs.update(extras(self))
        self.loop = EngineLoop.build(
            lambda: warmed(
                LLMEngine(EngineConfig(model=cfg.model, **engine_kwargs)), cfg.worker_id
            ),
            name=f"{cfg.worker_id}-engine",
        )
        release_freed_heap()
        engine_ticks(self.loop)
        return self.loop.engine

    def _serve(self) -> None:
        """Starts the gRPC server with every part's service (sets self.address), then joins the
        router's pool, if one is set, under the current role."""
        cfg = self.config
        max_workers = cfg.max_workers or 2 * self.loop.engine.scheduler.max_num_seqs + 16
        # a vision-language model's Reserve and Prefill carry the prompt's pixel values too
        images = MAX_PIXEL_VALUE_BYTES if self.loop.engine.image_encoder is not None else 0
        self._host = ServiceHost(
            cfg.worker_id,
            cfg.host,
            cfg.port,
            max_workers,
            MAX_MESSAGE_BYTES + images,
            security=cfg.security,
        )
        parts = list(self.parts.values())

        def add_services(server: grpc.Server) -> None:
            for part in parts:
                part.add_to(server)
            if len(parts) > 1:
                control = ControlServicer(self.gate, self.remaining, self._register_as)
                worker_pb2_grpc.add_WorkerControlServicer_to_server(control, server)

        self.address = self._host.start(add_services, tuple(p.service_name for p in parts))
        if cfg.registry_address:
            self.registration = register_worker(
                cfg.registry_address,
                self.role,
                cfg.worker_id,
                self.address,
                cfg.model,
                self.stats,
                security=cfg.security,
                deployment_id=cfg.deployment_id,
                model_id=cfg.model_id,
            )

    def _register_as(self, role: str) -> None:
        """Registers again under `role` before a switch answers (raises grpc.RpcError when the
        router refuses or cannot be reached); nothing to do without a router."""
        if self.registration is not None:
            self.registration.register_as(role)

    def _stop_serving(self) -> None:
        if self.registration is not None:  # heartbeats end first: the router drops this worker
            self.registration.stop()
            self.registration = None
        if self._host is not None:  # stop taking requests, end open streams
            self._host.stop(self.config.stop_grace_s)
            self._host = None

    def _stop_engine(self) -> None:
        if self.loop is not None:
            self.loop.stop()
            self.loop.engine.shutdown()
            self.loop = None
