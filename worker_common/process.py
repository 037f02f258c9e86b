"""The frame both worker processes share: their common settings, the engine built on its loop
thread, the gRPC server, pool registration, and the order things stop in. A worker subclasses
WorkerProcess, sets ROLE and SERVICE_NAME, and writes only what is its own:

    class DecodeWorker(WorkerProcess):
        ROLE, SERVICE_NAME = "decode", "pdserve.worker.v1.DecodeWorker"

        def start(self):
            try:
                engine = self._build_engine(engine_kwargs)
                ... its hand-off, KV server, servicer ...
                self._serve(lambda server: add_servicer(servicer, server), stats_fn)
            except BaseException:
                self.stop()
                raise
            return self

        def stop(self):
            self._stop_serving()   # registration, then the gRPC server (open streams end)
            ... its own parts ...
            self._stop_engine()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from engine import EngineConfig, LLMEngine
from engine.engine_loop import EngineLoop, warmed
from protos.pdserve.v1 import worker_pb2
from protos.security import INSECURE, ClusterSecurity
from worker_common.grpc_server import ServiceHost
from worker_common.registration import Registration, register_worker

MAX_MESSAGE_BYTES = 64 << 20  # long prompts' token id lists


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
    ROLE = ""  # "prefill" | "decode": the role it registers with
    SERVICE_NAME = ""  # its gRPC service, marked SERVING in the health service

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.loop: EngineLoop | None = None
        self._host: ServiceHost | None = None
        self.address: str | None = None
        self.registration: Registration | None = None

    def _build_engine(self, engine_kwargs: dict) -> LLMEngine:
        """The engine itself, not an LLM (an LLM shuts its engine down when collected), built and
        warmed on the loop thread that will step it (EngineLoop.build says why)."""
        cfg = self.config
        self.loop = EngineLoop.build(
            lambda: warmed(
                LLMEngine(EngineConfig(model=cfg.model, **engine_kwargs)), cfg.worker_id
            ),
            name=f"{cfg.worker_id}-engine",
        )
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
