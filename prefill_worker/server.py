"""A prefill worker process: engine (prefill-only requests) + loop thread + gRPC service.

    worker = PrefillWorker(PrefillWorkerConfig(model=model_dir)).start()
    stub = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(worker.address))
    ...
    worker.stop()
"""
from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine import LLM
from engine.engine_loop import EngineLoop
from kvtransfer.layout import KVLayout
from prefill_worker.service import PrefillServiceOptions, PrefillWorkerServicer
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
        self._server: grpc.Server | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self._health: health.HealthServicer | None = None
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
            self._executor = futures.ThreadPoolExecutor(cfg.max_workers,
                                                        thread_name_prefix=f"{cfg.worker_id}-grpc")
            self._server = grpc.server(
                self._executor,
                options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                         ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
            worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self.servicer, self._server)
            self._health = health.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
            port = self._server.add_insecure_port(f"{cfg.host}:{cfg.port}")
            if port == 0:
                raise OSError(f"cannot listen on {cfg.host}:{cfg.port}: set port to a free one")
            self.address = f"{cfg.host}:{port}"
            self._server.start()
        except BaseException:
            self.stop()
            raise
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("prefill worker %s serving on %s", cfg.worker_id, self.address)
        return self

    def stop(self) -> None:
        """Stops taking requests, then closes the KV channels and the engine loop."""
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        if self._server is not None:
            self._server.stop(grace=self.config.stop_grace_s).wait(self.config.stop_grace_s + 5)
            self._server = None
        if self._executor is not None:   # grpc does not own it: its threads would outlive stop()
            self._executor.shutdown(wait=True)
            self._executor = None
        if self.servicer is not None:
            self.servicer.close()
            self.servicer = None
        if self.loop is not None:
            self.loop.stop()
            self.loop.engine.shutdown()
            self.loop = None
