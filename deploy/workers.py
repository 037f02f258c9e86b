"""The launcher's workers: the settings each replica gets, the worker it builds, and WorkerActor,
the Ray actor it runs in.

Every worker of a disaggregated deployment carries both roles (worker_common/process.py: a
prefill part and a decode part around one engine) and starts serving its pool's role, so the
router can flip it to the other pool while it runs (router/flips.py, worker_common/role.py). A
colocated deployment's workers decode only:
they prefill their own prompts, and there is no other pool to flip to. `worker_config` builds
the settings in the driver; WorkerActor, created by deploy/launcher.py in the replica's placement
group, builds and starts the worker in its own process, and stops it when told.
"""

from __future__ import annotations

import dataclasses
import os

import ray


def worker_config(common: dict, role: str, kv_backend: str, flippable: bool):
    """The settings of one replica: `common` (WorkerConfig's fields) plus its role's own; a
    flippable worker's are DecodeWorkerConfig's (its prefill part keeps PrefillPart's defaults)."""
    if flippable or role == "decode":
        from pdserve.decode_worker.server import DecodeWorkerConfig

        return DecodeWorkerConfig(kv_backend=kv_backend, **common)
    from pdserve.prefill_worker.server import PrefillWorkerConfig

    return PrefillWorkerConfig(**common)


def build_worker(role: str, cfg, flippable: bool):
    """The worker `cfg` describes, serving `role`, with both roles' parts if `flippable` (not
    started)."""
    from pdserve.decode_worker.server import DecodePart, DecodeWorker
    from pdserve.prefill_worker.server import PrefillPart, PrefillWorker
    from pdserve.worker_common.process import WorkerProcess

    if flippable:
        return WorkerProcess(cfg, [DecodePart(cfg), PrefillPart()], role=role)
    return DecodeWorker(cfg) if role == "decode" else PrefillWorker(cfg)


def pin_to(cpus: list[int] | None) -> None:
    """Keep the calling thread, and the threads and processes it starts, on `cpus`."""
    if cpus:
        os.sched_setaffinity(0, cpus)


class WorkerActor:
    """One worker replica inside a Ray actor process."""

    def __init__(
        self,
        role: str,
        worker_config,
        num_threads: int,
        cpus: list[int] | None = None,
        flippable: bool = False,
    ):
        self.cpus = cpus
        pin_to(cpus)
        import torch  # the heavy imports, here: actors are created (and import) concurrently

        import pdserve.decode_worker.server  # noqa: F401
        import pdserve.prefill_worker.server  # noqa: F401

        torch.set_num_threads(num_threads)
        self.flippable = flippable
        self.role = role
        self.worker_config = worker_config
        self.worker = None

    def start(self) -> tuple[str, str]:
        """Loads the model, starts serving; returns the worker's gRPC address and its engine's
        serving mode (dtype, quantization and why)."""
        pin_to(self.cpus)  # the threads the worker starts (engine loop, gRPC, TP ranks) inherit it
        cfg = self.worker_config
        if not cfg.host:  # listen on, and advertise, this node's address
            cfg = dataclasses.replace(cfg, host=ray.util.get_node_ip_address())
        if hasattr(cfg, "kv_options"):  # its decode part's KV server listens there too
            cfg = dataclasses.replace(cfg, kv_options={"host": cfg.host, **cfg.kv_options})
        self.worker = build_worker(self.role, cfg, self.flippable).start()
        return self.worker.address, self.worker.loop.engine.mode_note

    def ping(self) -> bool:
        return self.worker is not None

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
