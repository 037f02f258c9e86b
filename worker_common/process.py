"""The frame both worker processes share: their common settings, the engine built on its loop
thread, the gRPC server, pool registration, and the order things stop in.

A worker (prefill_worker/, decode_worker/) subclasses WorkerProcess and writes only what is its
own. The launcher's actor, or a test, creates one with its config and calls `start()`, which
builds and warms the engine on its loop thread, serves gRPC and joins the router's pool; the
worker serves until `stop()`, which leaves the pool, closes the gRPC server, stops the worker's
own parts and then the engine.

    worker = DecodeWorker(DecodeWorkerConfig(model=model_dir)).start()
    stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(worker.address))
    ...
    worker.stop()
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

import grpc

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.engine.engine_loop import EngineLoop, warmed
from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.protos.security import INSECURE, ClusterSecurity
from pdserve.worker_common.grpc_server import ServiceHost
from pdserve.worker_common.registration import Registration, register_worker

MAX_MESSAGE_BYTES = 64 << 20  # long prompts' token id lists
# How often the engine loop gives freed heap back (release_freed_heap). tune_malloc lets glibc
# keep up to 256 MiB of freed heap for the KV frames' sake; without a trim a worker's RSS floats
# by the size of its last big transient (a long prefill's activations) and hides any growth.
HEAP_TRIM_PERIOD_S = 10.0


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


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker process takes; PrefillWorkerConfig and DecodeWorkerConfig add theirs."""

    model: str
    engine_kwargs: dict = field(default_factory=dict)  # LLM(model, **engine_kwargs)
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


class WorkerProcess:
    """A worker sets ROLE and SERVICE_NAME and writes `_start` and `_stop_own`:

        class DecodeWorker(WorkerProcess):
            ROLE, SERVICE_NAME = "decode", "pdserve.worker.v1.DecodeWorker"

            def _start(self):
                engine = self._build_engine(shared_dir)
                ... its hand-off, KV server, servicer ...
                self._serve(lambda server: add_servicer(servicer, server), stats_fn)

            def _stop_own(self):
                ... its own parts (between the gRPC server and the engine) ...

    `start` and `stop` do the rest, in the order the module docstring gives.
    """

    ROLE = ""  # "prefill" | "decode": the role it registers with
    SERVICE_NAME = ""  # its gRPC service, marked SERVING in the health service

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.loop: EngineLoop | None = None
        self._host: ServiceHost | None = None
        self.address: str | None = None
        self.registration: Registration | None = None

    @property
    def tp_size(self) -> int:
        return self.config.engine_kwargs.get("tensor_parallel_size", 1)

    def start(self) -> Self:
        """Builds and serves the worker (_start); on any failure stops what had started, then
        raises."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Registration and the gRPC server first (open streams end), then the worker's own
        parts, then the engine loop."""
        self._stop_serving()
        self._stop_own()
        self._stop_engine()

    def _start(self) -> None:
        raise NotImplementedError

    def _stop_own(self) -> None:
        """Closes what _start made besides the engine and the gRPC server; runs on a partial start
        too."""

    def _build_engine(self, shared_dir: str | None = None) -> LLMEngine:
        """The engine itself, not an LLM (an LLM shuts its engine down when collected), built and
        warmed on the loop thread that will step it (EngineLoop.build says why). shared_dir: put
        the KV pool in a shared file there (where another process or rank must map it), unless
        engine_kwargs already name a kv_cache_shared_dir."""
        cfg = self.config
        engine_kwargs = dict(cfg.engine_kwargs)
        if shared_dir and not engine_kwargs.get("kv_cache_shared_dir"):
            engine_kwargs["kv_cache_shared_dir"] = shared_dir
        self.loop = EngineLoop.build(
            lambda: warmed(
                LLMEngine(EngineConfig(model=cfg.model, **engine_kwargs)), cfg.worker_id
            ),
            name=f"{cfg.worker_id}-engine",
        )
        release_freed_heap()
        self.loop.every(HEAP_TRIM_PERIOD_S, release_freed_heap)
        return self.loop.engine

    def _serve(
        self,
        add_servicer: Callable[[grpc.Server], None],
        stats_fn: Callable[[], worker_pb2.WorkerStats],
    ) -> None:
        """Starts the gRPC server (sets self.address), then joins the router's pool if one is set."""
        cfg = self.config
        max_workers = cfg.max_workers or 2 * self.loop.engine.scheduler.max_num_seqs + 16
        self._host = ServiceHost(
            cfg.worker_id, cfg.host, cfg.port, max_workers, MAX_MESSAGE_BYTES, security=cfg.security
        )
        self.address = self._host.start(add_servicer, (self.SERVICE_NAME,))
        if cfg.registry_address:
            self.registration = register_worker(
                cfg.registry_address,
                self.ROLE,
                cfg.worker_id,
                self.address,
                cfg.model,
                stats_fn,
                security=cfg.security,
                deployment_id=cfg.deployment_id,
            )

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
