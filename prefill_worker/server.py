"""A prefill worker process: engine (prefill-only requests) + loop thread + gRPC service.

    worker = PrefillWorker(PrefillWorkerConfig(model=model_dir)).start()
    stub = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(worker.address))
    ...
    worker.stop()
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field


from engine import LLM
from engine.engine_loop import EngineLoop
from kvtransfer.layout import KVLayout
from prefill_worker.service import PrefillServiceOptions, PrefillWorkerServicer
from protos.grpc_server import ServiceHost
from protos.pdserve.v1 import worker_pb2_grpc

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
    max_workers: int = 16
    stop_grace_s: float = 1.0


class PrefillWorker:
    def __init__(self, config: PrefillWorkerConfig):
        self.config = config
        self.loop: EngineLoop | None = None
        self.layout: KVLayout | None = None
        self.servicer: PrefillWorkerServicer | None = None
        self._host: ServiceHost | None = None
        self.address: str | None = None

    def start(self) -> "PrefillWorker":
        cfg = self.config
        try:
            engine = LLM(cfg.model, **cfg.engine_kwargs).engine
            self.layout = KVLayout(**engine.kv_layout_spec())
            self.loop = EngineLoop(engine, name=f"{cfg.worker_id}-engine").start()
            self.servicer = PrefillWorkerServicer(self.loop, self.layout, PrefillServiceOptions(
                worker_id=cfg.worker_id, prefill_timeout_s=cfg.prefill_timeout_s,
                flush_timeout_s=cfg.flush_timeout_s))
            self._host = ServiceHost(cfg.worker_id, cfg.host, cfg.port, cfg.max_workers,
                                     MAX_MESSAGE_BYTES)
            self.address = self._host.start(
                lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self.servicer, s), (SERVICE_NAME,))
        except BaseException:
            self.stop()
            raise
        log.info("prefill worker %s serving on %s", cfg.worker_id, self.address)
        return self

    def stop(self) -> None:
        """Stops taking requests, then closes the KV channels and the engine loop."""
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
