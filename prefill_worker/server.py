"""A prefill worker process: engine (prefill-only requests) + loop thread + gRPC service, and
PrefillPart, the prefill role that any worker can carry (the launcher's workers carry both
roles, worker_common/role.py). Its frame (start and stop order, registration, usage) is
worker_common/process.py."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kvtransfer.backends import default_shared_dir, tune_malloc
from pdserve.kvtransfer.layout import KVLayout
from pdserve.prefill_worker.service import PrefillServiceOptions, PrefillWorkerServicer
from pdserve.prefill_worker.stage_push import StageSender
from pdserve.protos import tracing
from pdserve.protos.pdserve.v1 import worker_pb2_grpc
from pdserve.worker_common.process import WorkerConfig, WorkerProcess


@dataclass(frozen=True)
class PrefillWorkerConfig(WorkerConfig):
    """WorkerConfig's fields, plus the prefill timeouts. max_workers: each Prefill call holds a
    handler thread until its first token, queued prompts included, with room for Abort and Stats."""

    worker_id: str = "prefill-0"
    prefill_timeout_s: float = 60.0
    flush_timeout_s: float = 10.0


class PrefillPart:
    """The prefill role: the PrefillWorker service and its KV channels to decode workers. Under
    TP, rank 0 sends every rank's KV (from a shared-file pool); under pipeline stages, the first
    stage's, and each later stage's ranks push their own (stage_push.py)."""

    role, service_name = "prefill", "pdserve.worker.v1.PrefillWorker"

    def __init__(self, prefill_timeout_s: float = 60.0, flush_timeout_s: float = 10.0):
        self.prefill_timeout_s = prefill_timeout_s
        self.flush_timeout_s = flush_timeout_s
        self.layout: KVLayout | None = None
        self.servicer: PrefillWorkerServicer | None = None

    @classmethod
    def from_config(cls, cfg) -> PrefillPart:
        return cls(cfg.prefill_timeout_s, cfg.flush_timeout_s)

    def prepare(self) -> None:
        tune_malloc()  # frame-sized send buffers: see its docstring

    def shared_dir(self, tp_size: int) -> str | None:
        # rank 0 sends its stage's tensor-parallel ranks' KV (the later stages push their own)
        return default_shared_dir() if tp_size > 1 else None

    def engine_extras(self, worker: WorkerProcess) -> dict:
        """Under pipeline stages, the sender the later stages' ranks push their layers with."""
        if worker.config.engine_kwargs.get("pipeline_parallel_size", 1) == 1:
            return {}
        return dict(
            kv_stage_sender=StageSender(
                worker.config.security, flush_timeout_s=self.flush_timeout_s
            )
        )

    def start(self, worker: WorkerProcess, engine) -> None:
        cfg = worker.config
        self.layout = KVLayout(**engine.kv_layout_spec())
        self.servicer = PrefillWorkerServicer(
            worker.loop,
            self.layout,
            PrefillServiceOptions(
                worker_id=cfg.worker_id,
                prefill_timeout_s=self.prefill_timeout_s,
                flush_timeout_s=self.flush_timeout_s,
                security=cfg.security,
            ),
            engine.rank_kv_caches() if worker.tp_size > 1 else None,
            gate=worker.gate,
        )
        self.servicer.tracing = tracing.setup(
            "pdserve-prefill",
            cfg.otlp_traces_endpoint,
            cfg.trace_sample_ratio,
            worker_id=cfg.worker_id,
            exporter=cfg.trace_exporter,
        )

    def add_to(self, server) -> None:
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self.servicer, server)

    def stats(self):
        return self.servicer.Stats(None, None)

    def remaining(self) -> str:
        return ""  # a prefill's whole life is inside its Prefill call (the gate counts those)

    def close(self) -> None:
        """The KV channels, after the gRPC server."""
        if self.servicer is not None:
            if self.servicer.tracing is not None:  # the spans of the prefills that ended go out
                self.servicer.tracing.close()
            self.servicer.close()
            self.servicer = None


class PrefillWorker(WorkerProcess):
    """A worker that only prefills."""

    config: PrefillWorkerConfig

    def _parts(self):
        return [PrefillPart.from_config(self.config)]

    @property
    def layout(self) -> KVLayout | None:
        return self.parts["prefill"].layout

    @property
    def servicer(self) -> PrefillWorkerServicer | None:
        return self.parts["prefill"].servicer
