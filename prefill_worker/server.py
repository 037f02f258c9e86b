"""A prefill worker process: engine (prefill-only requests) + loop thread + gRPC service. Its
frame (start and stop order, registration, usage) is worker_common/process.py."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.kvtransfer.backends import default_shared_dir, tune_malloc
from pdserve.kvtransfer.layout import KVLayout
from pdserve.prefill_worker.service import PrefillServiceOptions, PrefillWorkerServicer
from pdserve.protos.pdserve.v1 import worker_pb2_grpc
from pdserve.worker_common.process import WorkerConfig, WorkerProcess

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillWorkerConfig(WorkerConfig):
    """WorkerConfig's fields, plus the prefill timeouts. max_workers: each Prefill call holds a
    handler thread until its first token, queued prompts included, with room for Abort and Stats."""

    worker_id: str = "prefill-0"
    prefill_timeout_s: float = 60.0
    flush_timeout_s: float = 10.0


class PrefillWorker(WorkerProcess):
    ROLE, SERVICE_NAME = "prefill", "pdserve.worker.v1.PrefillWorker"

    config: PrefillWorkerConfig
    # set by start()
    layout: KVLayout | None = None
    servicer: PrefillWorkerServicer | None = None

    def _start(self) -> None:
        cfg = self.config
        tune_malloc()  # frame-sized send buffers: see its docstring
        tp = self.tp_size
        engine = self._build_engine(default_shared_dir() if tp > 1 else None)  # rank 0 sends all
        self.layout = KVLayout(**engine.kv_layout_spec())
        self.servicer = PrefillWorkerServicer(
            self.loop,
            self.layout,
            PrefillServiceOptions(
                worker_id=cfg.worker_id,
                prefill_timeout_s=cfg.prefill_timeout_s,
                flush_timeout_s=cfg.flush_timeout_s,
                security=cfg.security,
            ),
            engine.rank_kv_caches() if tp > 1 else None,
        )
        self._serve(
            lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self.servicer, s),
            lambda: self.servicer.Stats(None, None),
        )
        log.info("prefill worker %s serving on %s", cfg.worker_id, self.address)

    def _stop_own(self) -> None:
        """The KV channels, after the gRPC server."""
        if self.servicer is not None:
            self.servicer.close()
            self.servicer = None
