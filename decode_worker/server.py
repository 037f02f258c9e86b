"""A decode worker process: engine + loop thread + hand-off + KV transport server + gRPC service.

    worker = DecodeWorker(DecodeWorkerConfig(model=model_dir)).start()
    stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(worker.address))
    ...
    worker.stop()
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from decode_worker.handoff import DecodeHandoff
from decode_worker.service import DecodeServiceOptions, DecodeWorkerServicer
from engine import EngineConfig, LLMEngine
from engine.engine_loop import EngineLoop, warmed
from kvtransfer.backends import BACKENDS, default_shared_dir, serve, tune_malloc
from kvtransfer.layout import KVLayout
from protos.grpc_server import ServiceHost
from protos.registration import register_worker
from protos.pdserve.v1 import worker_pb2_grpc
from protos.security import INSECURE, ClusterSecurity

log = logging.getLogger(__name__)
SERVICE_NAME = "pdserve.worker.v1.DecodeWorker"
MAX_MESSAGE_BYTES = 64 << 20   # long prompts' token id lists


@dataclass(frozen=True)
class DecodeWorkerConfig:
    model: str
    engine_kwargs: dict = field(default_factory=dict)   # LLM(model, **engine_kwargs)
    host: str = "127.0.0.1"
    port: int = 0                  # 0: pick a free port
    kv_backend: str = "grpc"
    kv_options: dict = field(default_factory=dict)      # serve(kv_backend, handler, **kv_options)
    worker_id: str = "decode-0"
    lease_ms: int = 10_000         # default reservation lease when a Reserve gives none
    max_lease_ms: int = 120_000    # longer leases asked by a Reserve are cut to this
    lease_sweep_s: float = 0.05
    # gRPC handler threads. Each open Stream holds one for its whole life, so the pool must cover
    # every sequence the engine may run plus those waiting for their KV, with room for Reserve,
    # Abort and Stats; None: 2 x the engine's max_num_seqs + 16. (16 threads made the 17th
    # concurrent stream, and the router's health checks, wait for a stream to end.)
    max_workers: int | None = None
    stop_grace_s: float = 1.0
    registry_address: str = ""   # a router's address: join its pool (protos/registration.py)
    # every RPC to this worker (and, decode, its KV channels) needs security.secret; the
    # router's Registry too. INSECURE: no check (in-process setups and tests)
    security: ClusterSecurity = field(default=INSECURE)
    deployment_id: str = ""      # sent with Register; the router refuses another deployment's workers

    def __post_init__(self):
        if self.kv_backend not in BACKENDS:
            raise ValueError(f"kv_backend must be one of {BACKENDS}, got {self.kv_backend!r}")
        if not 0 < self.lease_ms <= self.max_lease_ms:
            raise ValueError(f"lease_ms must be in (0, max_lease_ms={self.max_lease_ms}], got "
                             f"{self.lease_ms}")


class DecodeWorker:
    def __init__(self, config: DecodeWorkerConfig):
        self.config = config
        self.loop: EngineLoop | None = None
        self.handoff: DecodeHandoff | None = None
        self.layout: KVLayout | None = None
        self._kv_server = None
        self._host: ServiceHost | None = None
        self.address: str | None = None
        self.registration = None

    def start(self) -> "DecodeWorker":
        cfg = self.config
        try:
            tune_malloc()   # frame-sized receive buffers: see its docstring
            kwargs = dict(cfg.engine_kwargs)
            tp = kwargs.get("tensor_parallel_size", 1)
            # the hand-off writes every rank's pool from rank 0, and shm senders write into it
            if (tp > 1 or cfg.kv_backend == "shm") and not kwargs.get("kv_cache_shared_dir"):
                kwargs["kv_cache_shared_dir"] = default_shared_dir()
            # the engine itself, not an LLM (an LLM shuts its engine down when collected), built
            # on the loop thread that will step it (EngineLoop.build says why)
            self.loop = EngineLoop.build(lambda: warmed(LLMEngine(EngineConfig(model=cfg.model, **kwargs)),
                                                        cfg.worker_id), name=f"{cfg.worker_id}-engine")
            engine = self.loop.engine
            self.layout = KVLayout(**engine.kv_layout_spec())
            rank_caches = engine.rank_kv_caches()
            self.handoff = DecodeHandoff(self.loop, self.layout, lease_s=cfg.lease_ms / 1000,
                                         sweep_s=cfg.lease_sweep_s, rank_caches=rank_caches)
            kv_options = dict(cfg.kv_options)
            if cfg.kv_backend == "shm":
                kv_options.update(kv_cache=rank_caches[0], kv_path=engine.kv_cache_paths)
            self._kv_server = serve(cfg.kv_backend, self.handoff.on_frame, security=cfg.security,
                                    **kv_options)
            servicer = DecodeWorkerServicer(self.loop, self.handoff, DecodeServiceOptions(
                worker_id=cfg.worker_id, kv_backend=cfg.kv_backend,
                kv_address=self._kv_server.address, default_lease_ms=cfg.lease_ms,
                max_lease_ms=cfg.max_lease_ms, tp_size=tp))
            max_workers = cfg.max_workers or 2 * engine.scheduler.max_num_seqs + 16
            self._host = ServiceHost(cfg.worker_id, cfg.host, cfg.port, max_workers,
                                     MAX_MESSAGE_BYTES, security=cfg.security)
            self.address = self._host.start(
                lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, s), (SERVICE_NAME,))
            if cfg.registry_address:
                self.registration = register_worker(
                    cfg.registry_address, "decode", cfg.worker_id, self.address, cfg.model,
                    lambda: servicer.Stats(None, None), security=cfg.security,
                    deployment_id=cfg.deployment_id)
        except BaseException:
            self.stop()
            raise
        log.info("decode worker %s serving on %s, KV on %s", cfg.worker_id, self.address,
                 self._kv_server.address)
        return self

    def stop(self) -> None:
        """Stops taking requests, ends open streams, then the KV channel and the engine loop."""
        if self.registration is not None:   # heartbeats end first: the router drops this worker
            self.registration.stop()
            self.registration = None
        if self._host is not None:   # stop taking requests, end open streams
            self._host.stop(self.config.stop_grace_s)
            self._host = None
        if self._kv_server is not None:
            self._kv_server.stop()
            self._kv_server = None
        if self.loop is not None:
            self.loop.stop()
            self.loop.engine.shutdown()
            self.loop = None
