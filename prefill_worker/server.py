"""A prefill worker process: engine (prefill-only requests) + loop thread + gRPC service.

    worker = PrefillWorker(PrefillWorkerConfig(model=model_dir)).start()
    stub = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(worker.address))
    ...
    worker.stop()

The frame (engine on its loop thread, gRPC server, registration, stop order) is
worker_common/process.py, shared with the decode worker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvtransfer.backends import default_shared_dir, tune_malloc
from kvtransfer.layout import KVLayout
from prefill_worker.service import PrefillServiceOptions, PrefillWorkerServicer
from protos.pdserve.v1 import worker_pb2_grpc
from worker_common.process import WorkerConfig, WorkerProcess

log = logging.getLogger(__name__)
SERVICE_NAME = "pdserve.worker.v1.PrefillWorker"


@dataclass(frozen=True)
class PrefillWorkerConfig(WorkerConfig):
    """WorkerConfig's fields, plus the prefill timeouts. max_workers: each Prefill call holds a
    handler thread until its first token, queued prompts included, with room for Abort and Stats."""

    worker_id: str = "prefill-0"
    prefill_timeout_s: float = 60.0
    flush_timeout_s: float = 10.0


class PrefillWorker(WorkerProcess):
    ROLE = "prefill"
    SERVICE_NAME = SERVICE_NAME

    def __init__(self, config: PrefillWorkerConfig):
        super().__init__(config)
        self.layout: KVLayout | None = None
        self.servicer: PrefillWorkerServicer | None = None

    def start(self) -> PrefillWorker:
        cfg = self.config
        try:
            tune_malloc()  # frame-sized send buffers: see its docstring
            kwargs = dict(cfg.engine_kwargs)
            tp = kwargs.get("tensor_parallel_size", 1)
            if tp > 1 and not kwargs.get("kv_cache_shared_dir"):  # rank 0 sends every rank's heads
                kwargs["kv_cache_shared_dir"] = default_shared_dir()
            engine = self._build_engine(kwargs)
            self.layout = KVLayout(**engine.kv_layout_spec())
            rank_caches = engine.rank_kv_caches() if tp > 1 else None
            self.servicer = PrefillWorkerServicer(
                self.loop,
                self.layout,
                PrefillServiceOptions(
                    worker_id=cfg.worker_id,
                    prefill_timeout_s=cfg.prefill_timeout_s,
                    flush_timeout_s=cfg.flush_timeout_s,
                    security=cfg.security,
                ),
                rank_caches,
            )
            self._serve(
                lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self.servicer, s),
                lambda: self.servicer.Stats(None, None),
            )
        except BaseException:
            self.stop()
            raise
        log.info("prefill worker %s serving on %s", cfg.worker_id, self.address)
        return self

    def stop(self) -> None:
        """Stops taking requests, then closes the KV channels and the engine loop."""
        self._stop_serving()
        if self.servicer is not None:
            self.servicer.close()
            self.servicer = None
        self._stop_engine()
