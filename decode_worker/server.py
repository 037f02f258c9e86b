"""A decode worker process: engine + loop thread + hand-off + KV transport server + gRPC service,
and DecodePart, the decode role that any worker can carry (the launcher's workers carry both
roles, worker_common/role.py). Its frame (start and stop order, registration, usage) is
worker_common/process.py."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field

import torch

from pdserve.decode_worker.handoff import DecodeHandoff
from pdserve.decode_worker.service import DecodeServiceOptions, DecodeWorkerServicer
from pdserve.engine.config import DEFAULT_CPU_KV_BYTES, available_memory_bytes
from pdserve.kvtransfer.backends import (
    BACKENDS,
    cuda_ipc_backend,
    default_shared_dir,
    serve,
    tune_malloc,
)
from pdserve.kvtransfer.backends.claims import CLAIMING, Grants
from pdserve.kvtransfer.backends.shm_backend import locality
from pdserve.kvtransfer.choose import (
    AUTO,
    STATE_BACKENDS,
    Ranking,
    check_state_backend,
    host_id,
)
from pdserve.kvtransfer.layout import KVLayout
from pdserve.protos import tracing
from pdserve.protos.pdserve.v1 import worker_pb2_grpc
from pdserve.worker_common.process import WorkerConfig, WorkerProcess

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeWorkerConfig(WorkerConfig):
    """WorkerConfig's fields, plus the KV backend (one of BACKENDS, or "auto": grpc and, where the
    KV pool can be a shared file, shm, kvtransfer/choose.py) and the leases. max_workers: each open Stream
    holds a handler thread for its whole life, so the pool must cover every sequence the engine
    may run plus those waiting for their KV, with room for Reserve, Abort and Stats (16 threads
    made the 17th concurrent stream, and the router's health checks, wait for a stream to end)."""

    worker_id: str = "decode-0"
    kv_backend: str = "grpc"
    # on "auto": the ranking it serves and offers by (kvtransfer/choose.py Ranking.to_dict(), the
    # launcher's from kvtransfer.profile); None: the built-in one
    kv_ranking: dict | None = None
    kv_options: dict = field(default_factory=dict)  # serve(kv_backend, handler, **kv_options)
    lease_ms: int = 10_000  # default reservation lease when a Reserve gives none
    max_lease_ms: int = 120_000  # longer leases asked by a Reserve are cut to this
    lease_sweep_s: float = 0.05

    def __post_init__(self):
        if self.kv_backend not in BACKENDS + (AUTO,):
            raise ValueError(
                f"kv_backend must be one of {BACKENDS + (AUTO,)}, got {self.kv_backend!r}"
            )
        Ranking.from_dict(self.kv_ranking)  # raises ValueError on a malformed one
        if self.engine_kwargs.get("pipeline_parallel_size", 1) > 1:
            raise ValueError(
                "a decode worker runs in one pipeline stage: set pipeline_parallel_size to 1 "
                "for the decode pool (prefill pools may use stages; decode would pay every "
                "stage per token)"
            )
        if not 0 < self.lease_ms <= self.max_lease_ms:
            raise ValueError(
                f"lease_ms must be in (0, max_lease_ms={self.max_lease_ms}], got {self.lease_ms}"
            )


def _locality(backend: str, address: str) -> str:
    """What a sender compares to tell that `backend`'s offer at `address` is within its reach."""
    if backend == "shm":
        return locality(address)
    if backend == "cuda_ipc":
        return cuda_ipc_backend.locality(address)
    return ""


class DecodePart:
    """The decode role: reservations and the hand-off that fills them, the KV transport server
    prefill workers push into, and the DecodeWorker service. `cfg` has DecodeWorkerConfig's
    fields (checked there)."""

    role, service_name = "decode", "pdserve.worker.v1.DecodeWorker"

    def __init__(self, cfg: DecodeWorkerConfig):
        self.cfg = cfg
        self.layout: KVLayout | None = None
        self.handoff: DecodeHandoff | None = None
        self.servicer: DecodeWorkerServicer | None = None
        self._kv_server = None
        self._kv_servers: dict = {}  # backend -> its server; more than one on "auto"

    @classmethod
    def from_config(cls, cfg) -> DecodePart:
        return cls(cfg)

    def prepare(self) -> None:
        tune_malloc()  # frame-sized receive buffers: see its docstring

    def shared_dir(self, num_ranks: int) -> str | None:
        # the hand-off writes every rank's pool from rank 0, and shm senders write into it
        if num_ranks > 1 or self.cfg.kv_backend == "shm":
            return default_shared_dir()
        if self.cfg.kv_backend == AUTO and self._room_for_shm():
            return default_shared_dir()
        return None

    def engine_extras(self, worker: WorkerProcess) -> dict:
        """A private pool that a nixl sender on this host writes into is put on huge pages
        (kvpool.new_private_pool says why)."""
        return {"kv_cache_huge_pages": True} if self.cfg.kv_backend == "nixl" else {}

    def _room_for_shm(self) -> bool:
        """On "auto": whether the KV pool can live in a shared file, so that shm can be offered:
        it is in CPU memory, and the shared folder has room for it (a container's /dev/shm is
        often 64 MiB). Otherwise the worker offers grpc alone, and says why."""
        engine = self.cfg.engine_kwargs
        device = engine.get("device", "auto")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device != "cpu":
            return False
        kv = engine.get("kv_cache_memory")
        if kv is None:
            kv = DEFAULT_CPU_KV_BYTES
        elif isinstance(kv, float):
            kv = int(kv * available_memory_bytes("cpu"))
        directory = default_shared_dir()
        free = shutil.disk_usage(directory).free
        if free < kv:
            log.info(
                "%s: kvtransfer auto offers grpc only: %s has %.0f MiB free and the KV pool "
                "needs %.0f MiB (make it larger, e.g. docker run --shm-size, to offer shm)",
                self.cfg.worker_id,
                directory,
                free / 2**20,
                kv / 2**20,
            )
            return False
        return True

    def start(self, worker: WorkerProcess, engine) -> None:
        cfg = self.cfg
        check_state_backend(engine.model_config, cfg.kv_backend)
        self.layout = KVLayout(**engine.kv_layout_spec())
        rank_caches = engine.rank_kv_caches()
        kv_options = dict(cfg.kv_options)
        grants_options = kv_options.pop("grants", {})
        grants = None
        backends = self._backends(engine)
        if CLAIMING & set(backends):  # the hand-off and those servers share the write grants
            grants = Grants(**grants_options)
        self.handoff = DecodeHandoff(
            worker.loop,
            self.layout,
            lease_s=cfg.lease_ms / 1000,
            sweep_s=cfg.lease_sweep_s,
            rank_caches=rank_caches,
            grants=grants,
        )
        for backend in backends:
            options = dict(kv_options)
            if backend in CLAIMING:
                options.update(grants=grants)
            if backend == "nixl":
                options.update(kv_caches=rank_caches)
            if backend == "shm":
                options.update(kv_cache=rank_caches[0], kv_path=engine.kv_cache_paths)
            if backend == "cuda_ipc":
                options.update(kv_cache=rank_caches[0])
            try:
                self._kv_servers[backend] = serve(
                    backend, self.handoff.on_frame, security=cfg.security, **options
                )
            except (ValueError, RuntimeError) as e:
                if cfg.kv_backend != AUTO or backend != "cuda_ipc":
                    raise
                # the pool cannot be exported (not one whole CUDA storage): the host path serves
                log.warning("not offering cuda_ipc: %s", e)
        self._kv_server = self._kv_servers["grpc" if cfg.kv_backend == AUTO else cfg.kv_backend]
        self.servicer = DecodeWorkerServicer(
            worker.loop,
            self.handoff,
            DecodeServiceOptions(
                worker_id=cfg.worker_id,
                kv_backend="grpc" if cfg.kv_backend == AUTO else cfg.kv_backend,
                kv_address=self._kv_server.address,
                kv_offers=self._offers(),
                kv_locality=""
                if cfg.kv_backend == AUTO
                else _locality(cfg.kv_backend, self._kv_server.address),
                default_lease_ms=cfg.lease_ms,
                max_lease_ms=cfg.max_lease_ms,
                tp_size=worker.tp_size,
            ),
            gate=worker.gate,
        )
        self.servicer.tracing = tracing.setup(
            "pdserve-decode",
            cfg.otlp_traces_endpoint,
            cfg.trace_sample_ratio,
            worker_id=cfg.worker_id,
            exporter=cfg.trace_exporter,
        )

    def _backends(self, engine) -> tuple[str, ...]:
        """The backends this worker serves: its one, or on "auto" grpc, shm when its KV pool is
        in host memory (shared files), and nixl or torch where installed and the ranking puts
        them first for a sender here or elsewhere (kvtransfer/choose.py Ranking.served), in the
        ranking's same-host order; for a hybrid model only those that carry its recurrent
        state (STATE_BACKENDS)."""
        if self.cfg.kv_backend != AUTO:
            return (self.cfg.kv_backend,)
        on_host = (  # (Mamba2's is empty: no pool to share)
            bool(engine.kv_cache_paths)
            and engine.model_config.num_kv_layers > 0
            and all(c.device.type == "cpu" for c in engine.rank_kv_caches())
        )
        caches = engine.rank_kv_caches()
        # cuda_ipc: one CUDA pool that a sender on its GPU opens (kvtransfer/choose.py)
        on_cuda = len(caches) == 1 and caches[0].device.type == "cuda"
        served = Ranking.from_dict(self.cfg.kv_ranking).served(on_host, on_cuda=on_cuda)
        if engine.model_config.recurrent_layers:  # (those that carry a hybrid's state frames)
            return tuple(b for b in served if b in STATE_BACKENDS)
        return served

    def _offers(self) -> tuple[tuple[str, str, str, str, int], ...]:
        """(backend, address, locality, host, cross-host rank) of each backend served on
        "auto", in the same-host order (kvtransfer/choose.py); () else."""
        if self.cfg.kv_backend != AUTO:
            return ()
        cross = Ranking.from_dict(self.cfg.kv_ranking).cross_host
        return tuple(
            (
                b,
                server.address,
                _locality(b, server.address),
                host_id(),
                cross.index(b) + 1 if b in cross else 0,
            )
            for b, server in self._kv_servers.items()
        )

    @property
    def kv_backends(self) -> str:
        """What the start table says of this worker's KV channel: its backend, or on "auto" what
        it offers, best first ("auto: shm, grpc")."""
        if self.cfg.kv_backend != AUTO:
            return self.cfg.kv_backend
        return "auto: " + ", ".join(self._kv_servers) if self._kv_servers else AUTO

    @property
    def kv_address(self) -> str | None:
        return self._kv_server.address if self._kv_server is not None else None

    def add_to(self, server) -> None:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self.servicer, server)

    def stats(self):
        return self.servicer.Stats(None, None)

    def remaining(self) -> str:
        reserved = self.handoff.num_reserved if self.handoff is not None else 0
        return f"{reserved} reservation(s)" if reserved else ""

    def unhealthy(self) -> str:
        """Why this part must not be given work ("" when it may): blocks held past the bound
        for a KV write that may still land (nixl: decode_worker/handoff.py)."""
        return self.handoff.unhealthy if self.handoff is not None else ""

    def close(self) -> None:
        """The KV channel, after the gRPC server (open streams have ended)."""
        for server in self._kv_servers.values():
            server.stop()
        self._kv_servers, self._kv_server = {}, None
        if self.servicer is not None and self.servicer.tracing is not None:
            self.servicer.tracing.close()  # the spans of the streams that ended go out
            self.servicer.tracing = None


class DecodeWorker(WorkerProcess):
    """A worker that only decodes."""

    config: DecodeWorkerConfig

    def _parts(self):
        return [DecodePart(self.config)]

    @property
    def layout(self) -> KVLayout | None:
        return self.parts["decode"].layout

    @property
    def handoff(self) -> DecodeHandoff | None:
        return self.parts["decode"].handoff
