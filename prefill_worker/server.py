"""A prefill worker process: engine (prefill-only requests) + loop thread + gRPC service.

    worker = PrefillWorker(PrefillWorkerConfig(model=model_dir)).start()
    stub = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(worker.address))
    ...
    worker.stop()
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine import EngineConfig, LLMEngine
from engine.engine_loop import EngineLoop, warmed
from kvtransfer.backends import default_shared_dir, tune_malloc
from kvtransfer.layout import KVLayout
from prefill_worker.service import PrefillServiceOptions, PrefillWorkerServicer
from protos.grpc_server import ServiceHost
from protos.registration import register_worker
from protos.pdserve.v1 import worker_pb2_grpc
from protos.security import INSECURE, ClusterSecurity

log = logging.getLogger(__name__)
SERVICE_NAME = "pdserve.worker.v1.PrefillWorker"
MAX_MESSAGE_BYTES = 64 << 20   # long prompts' token id lists


@dataclass(frozen=True)
class PrefillWorkerConfig:
    model: str
    engine_kwargs: dict = field(default_factory=dict)   # LLM(model, **engine_kwargs)
    host: str = "127.0.0.1"
    port: int = 0                  # 0: pick a free port
    worker_id: str = "prefill-0"
    prefill_timeout_s: float = 60.0
    flush_timeout_s: float = 10.0
    # gRPC handler threads: each Prefill call holds one until its first token, queued prompts
    # included, with room for Abort and Stats; None: 2 x the engine's max_num_seqs + 16
    max_workers: int | None = None
    stop_grace_s: float = 1.0
    registry_address: str = ""   # a router's address: join its pool (protos/registration.py)
    # every RPC to this worker (and, decode, its KV channels) needs security.secret; the
    # router's Registry too. INSECURE: no check (in-process setups and tests)
    security: ClusterSecurity = field(default=INSECURE)
    deployment_id: str = ""      # sent with Register; the router refuses another deployment's workers


class PrefillWorker:
    def __init__(self, config: PrefillWorkerConfig):
        self.config = config
        self.loop: EngineLoop | None = None
        self.layout: KVLayout | None = None
        self.servicer: PrefillWorkerServicer | None = None
        self._host: ServiceHost | None = None
        self.address: str | None = None
        self.registration = None

    def start(self) -> "PrefillWorker":
        cfg = self.config
        try:
            tune_malloc()   # frame-sized send buffers: see its docstring
            kwargs = dict(cfg.engine_kwargs)
            tp = kwargs.get("tensor_parallel_size", 1)
            if tp > 1 and not kwargs.get("kv_cache_shared_dir"):   # rank 0 sends every rank's heads
                kwargs["kv_cache_shared_dir"] = default_shared_dir()
            # the engine itself, not an LLM (an LLM shuts its engine down when collected), built
            # on the loop thread that will step it (EngineLoop.build says why)
            self.loop = EngineLoop.build(lambda: warmed(LLMEngine(EngineConfig(model=cfg.model, **kwargs)),
                                                        cfg.worker_id), name=f"{cfg.worker_id}-engine")
            engine = self.loop.engine
            self.layout = KVLayout(**engine.kv_layout_spec())
            rank_caches = engine.rank_kv_caches() if tp > 1 else None
            self.servicer = PrefillWorkerServicer(self.loop, self.layout, PrefillServiceOptions(
                worker_id=cfg.worker_id, prefill_timeout_s=cfg.prefill_timeout_s,
                flush_timeout_s=cfg.flush_timeout_s, security=cfg.security), rank_caches)
            max_workers = cfg.max_workers or 2 * engine.scheduler.max_num_seqs + 16
            self._host = ServiceHost(cfg.worker_id, cfg.host, cfg.port, max_workers,
                                     MAX_MESSAGE_BYTES, security=cfg.security)
            self.address = self._host.start(
                lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self.servicer, s), (SERVICE_NAME,))
            if cfg.registry_address:
                self.registration = register_worker(
                    cfg.registry_address, "prefill", cfg.worker_id, self.address, cfg.model,
                    lambda: self.servicer.Stats(None, None), security=cfg.security,
                    deployment_id=cfg.deployment_id)
        except BaseException:
            self.stop()
            raise
        log.info("prefill worker %s serving on %s", cfg.worker_id, self.address)
        return self

    def stop(self) -> None:
        """Stops taking requests, then closes the KV channels and the engine loop."""
        if self.registration is not None:   # heartbeats end first: the router drops this worker
            self.registration.stop()
            self.registration = None
        if self._host is not None:   # stop taking requests, end open streams
            self._host.stop(self.config.stop_grace_s)
            self._host = None
        if self.servicer is not None:
            self.servicer.close()
            self.servicer = None
        if self.loop is not None:
            self.loop.stop()
            self.loop.engine.shutdown()
            self.loop = None
