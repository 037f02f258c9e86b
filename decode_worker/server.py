"""A decode worker process: engine + loop thread + hand-off + KV transport server + gRPC service.
Its frame (start and stop order, registration, usage) is worker_common/process.py."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pdserve.decode_worker.handoff import DecodeHandoff
from pdserve.decode_worker.service import DecodeServiceOptions, DecodeWorkerServicer
from pdserve.kvtransfer.backends import BACKENDS, default_shared_dir, serve, tune_malloc
from pdserve.kvtransfer.layout import KVLayout
from pdserve.protos.pdserve.v1 import worker_pb2_grpc
from pdserve.worker_common.process import WorkerConfig, WorkerProcess

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeWorkerConfig(WorkerConfig):
    """WorkerConfig's fields, plus the KV backend and the leases. max_workers: each open Stream
    holds a handler thread for its whole life, so the pool must cover every sequence the engine
    may run plus those waiting for their KV, with room for Reserve, Abort and Stats (16 threads
    made the 17th concurrent stream, and the router's health checks, wait for a stream to end)."""

    worker_id: str = "decode-0"
    kv_backend: str = "grpc"
    kv_options: dict = field(default_factory=dict)  # serve(kv_backend, handler, **kv_options)
    lease_ms: int = 10_000  # default reservation lease when a Reserve gives none
    max_lease_ms: int = 120_000  # longer leases asked by a Reserve are cut to this
    lease_sweep_s: float = 0.05

    def __post_init__(self):
        if self.kv_backend not in BACKENDS:
            raise ValueError(f"kv_backend must be one of {BACKENDS}, got {self.kv_backend!r}")
        if not 0 < self.lease_ms <= self.max_lease_ms:
            raise ValueError(
                f"lease_ms must be in (0, max_lease_ms={self.max_lease_ms}], got {self.lease_ms}"
            )


class DecodeWorker(WorkerProcess):
    ROLE, SERVICE_NAME = "decode", "pdserve.worker.v1.DecodeWorker"

    config: DecodeWorkerConfig
    # set by start()
    layout: KVLayout | None = None
    handoff: DecodeHandoff | None = None
    _kv_server = None

    def _start(self) -> None:
        cfg = self.config
        tune_malloc()  # frame-sized receive buffers: see its docstring
        # the hand-off writes every rank's pool from rank 0, and shm senders write into it
        shared = self.tp_size > 1 or cfg.kv_backend == "shm"
        engine = self._build_engine(default_shared_dir() if shared else None)
        self.layout = KVLayout(**engine.kv_layout_spec())
        rank_caches = engine.rank_kv_caches()
        self.handoff = DecodeHandoff(
            self.loop,
            self.layout,
            lease_s=cfg.lease_ms / 1000,
            sweep_s=cfg.lease_sweep_s,
            rank_caches=rank_caches,
        )
        kv_options = dict(cfg.kv_options)
        if cfg.kv_backend == "shm":
            kv_options.update(kv_cache=rank_caches[0], kv_path=engine.kv_cache_paths)
        self._kv_server = serve(
            cfg.kv_backend, self.handoff.on_frame, security=cfg.security, **kv_options
        )
        servicer = DecodeWorkerServicer(
            self.loop,
            self.handoff,
            DecodeServiceOptions(
                worker_id=cfg.worker_id,
                kv_backend=cfg.kv_backend,
                kv_address=self._kv_server.address,
                default_lease_ms=cfg.lease_ms,
                max_lease_ms=cfg.max_lease_ms,
                tp_size=self.tp_size,
            ),
        )
        self._serve(
            lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, s),
            lambda: servicer.Stats(None, None),
        )
        log.info(
            "decode worker %s serving on %s, KV on %s",
            cfg.worker_id,
            self.address,
            self._kv_server.address,
        )

    def _stop_own(self) -> None:
        """The KV channel, after the gRPC server (open streams have ended)."""
        if self._kv_server is not None:
            self._kv_server.stop()
            self._kv_server = None
