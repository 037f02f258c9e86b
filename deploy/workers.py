"""The launcher's workers: the settings each replica gets, the worker it builds, and WorkerActor,
the Ray actor it runs in.

Every worker of a disaggregated deployment (but one whose engine runs in pipeline stages, which
only prefills) carries both roles (worker_common/process.py: a
prefill part and a decode part around one engine) and starts serving its pool's role, so the
router can flip it to the other pool while it runs (router/flips.py, worker_common/role.py). A
colocated deployment's workers decode only:
they prefill their own prompts, and there is no other pool to flip to. `worker_config` builds
the settings in the driver; WorkerActor, created by deploy/launcher.py in the replica's placement
group, builds and starts the worker in its own process, and stops it when told. While it starts,
the actor records the start's stages (worker_common/start_stages.py) and `stages` hands them to the
launcher as they come (the actor runs its calls on a few threads, so `stages` answers while
`start` is still busy); once started, `info` says where and how it serves (deploy/start_table.py
prints it). A started worker whose engine broke (a tensor-parallel or pipeline rank died) exits,
so the supervisor replaces it as after any death. A worker of several ranks (tp x pp) starts
ranks 1..N-1 as Ray actors on its placement group's other bundles, which may sit on other nodes
(deploy/rank_actors.py); they die with the actor's process. On this machine the worker's config carries no cluster secret: the actor is given the
path of the file holding it (deploy/secret_files.py) and reads it once, when `start` begins, so the
secret is in no process's environment and not in Ray's copy of the actor's arguments.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time

import ray

BROKEN_POLL_S = 1.0  # how often a started worker looks whether it must exit (ExitWatch)
# a worker unhealthy this long without recovering exits to be replaced, once the streams it
# still decodes have finished, or, past UNHEALTHY_DRAIN_S more, with them (ExitWatch)
UNHEALTHY_EXIT_S = 60.0
UNHEALTHY_DRAIN_S = 600.0


class ExitWatch:
    """When a started worker's process exits so that the supervisor replaces it with a fresh one
    (deploy/supervisor.py), as after any death: at once when its engine broke (one of its ranks
    died: engine/engine_loop.py), and once it has reported itself unhealthy for `exit_s` without
    a break. Unhealthy means blocks held past their bound for a KV write that may still land (a
    nixl sender that hung, or died on another host without its connection closing): the worker
    may recover when the claim ends after all, but nothing else ends such a hold, and a process's
    end does: its pool and NIXL registration go with it, so no late write reaches a block given
    to another request, and the fresh worker serves with every block free. The router sends an
    unhealthy worker no new work, so the streams it still decodes are let finish first (`busy`),
    for at most `drain_s` more."""

    def __init__(self, exit_s: float = UNHEALTHY_EXIT_S, drain_s: float = UNHEALTHY_DRAIN_S):
        self.exit_s, self.drain_s = exit_s, drain_s
        self.since: float | None = None  # when the current unhealthy stretch began

    def reason(self, broken: str, unhealthy: str, busy: bool, now: float) -> str:
        """Why to exit now, "" to go on. busy: sequences still in the engine."""
        if broken:
            return broken
        if not unhealthy:
            self.since = None
            return ""
        if self.since is None:
            self.since = now
        waited = now - self.since
        if waited < self.exit_s or (busy and waited < self.exit_s + self.drain_s):
            return ""
        cut = ", cutting the streams it still decoded" if busy else ""
        return f"unhealthy for {waited:.0f}s{cut}: {unhealthy}"


def worker_config(
    common: dict, role: str, kv_backend: str, flippable: bool, kv_ranking: dict | None = None
):
    """The settings of one replica: `common` (WorkerConfig's fields) plus its role's own; a
    flippable worker's are DecodeWorkerConfig's (its prefill part keeps PrefillPart's defaults).
    kv_ranking: on kvtransfer.backend "auto", the ranking its decode part serves and offers by
    (kvtransfer/choose.py Ranking.to_dict()); None: the built-in one."""
    if flippable or role == "decode":
        from pdserve.decode_worker.server import DecodeWorkerConfig

        return DecodeWorkerConfig(kv_backend=kv_backend, kv_ranking=kv_ranking, **common)
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


def log_file() -> str | None:
    """The file this process's stderr goes to (a Ray worker's log: Ray points it at
    <session>/logs/worker-*.err), or None when it is not a file."""
    try:
        path = os.readlink("/proc/self/fd/2")
    except OSError:
        return None
    return path if path.startswith("/") and os.path.isfile(path) else None


def pin_to(cpus: list[int] | None) -> None:
    """Keep the calling thread, and the threads and processes it starts, on `cpus`."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def at_normal_priority() -> int:
    """Brings the calling thread, and the threads it starts, back to niceness 0, and returns the
    niceness it runs at. Ray starts its worker processes niced (worker_niceness, 15 unless the
    cluster's raylet was started with RAY_worker_niceness=0) so that its own processes stay
    responsive; but a pdserve worker is the serving path, and at 15 it gets about a thirtieth of
    a core beside any ordinary busy process. Lowering niceness needs privilege (root,
    CAP_SYS_NICE or RLIMIT_NICE); without it the value stays and the start table shows it."""
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)  # on Linux: the calling thread's
    except (AttributeError, OSError):  # no such call here
        return 0
    if current > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
            return 0
        except OSError:
            pass
    return current


class WorkerActor:
    """One worker replica inside a Ray actor process."""

    def __init__(
        self,
        role: str,
        worker_config,
        num_threads: int,
        cpus: list[int] | None = None,
        flippable: bool = False,
        secret_file: str | None = None,
    ):
        self.cpus = cpus
        self.secret_file = secret_file  # the cluster secret's file, read at start
        pin_to(cpus)
        self.niceness = at_normal_priority()
        import torch  # the heavy imports, here: actors are created (and import) concurrently

        import pdserve.decode_worker.server  # noqa: F401
        import pdserve.prefill_worker.server  # noqa: F401

        torch.set_num_threads(num_threads)
        self.flippable = flippable
        self.role = role
        self.worker_config = worker_config
        self.worker = None
        from pdserve.worker_common.start_stages import StageLog, log_to_stderr

        log_to_stderr()  # this process's log file: Ray points stderr at it
        # and every pdserve logger's lines there, refusals and failures of requests included
        from pdserve.deploy.config.schema import ObservabilitySettings
        from pdserve.logs import configure_console

        configure_console(
            ObservabilitySettings(
                log_level=worker_config.log_level, log_format=worker_config.log_format
            )
        )
        self.start_stages = StageLog(worker_config.worker_id)

    def start(self, registry_address: str) -> tuple[str, str]:
        """Loads the model, starts serving and joins the router at `registry_address` (given
        here, not at creation: `up` creates the actors before its router listens, so that they
        import while it starts); returns the worker's gRPC address and its engine's serving mode
        in a line (engine/precision.mode_headline; the reasons are in the start's precision stage
        and this worker's log)."""
        pin_to(self.cpus)  # the threads the worker starts (engine loop, gRPC, TP ranks) inherit it
        self.niceness = at_normal_priority()  # and this
        cfg = dataclasses.replace(self.worker_config, registry_address=registry_address)
        if self.secret_file is not None:  # the secret and TLS key from 0600 files (not the config)
            from pdserve.deploy.secret_files import read_secret_file, tls_key_beside

            security = dataclasses.replace(cfg.security, secret=read_secret_file(self.secret_file))
            if security.tls is not None and not security.tls.key_pem:
                tls = dataclasses.replace(security.tls, key_pem=tls_key_beside(self.secret_file))
                security = dataclasses.replace(security, tls=tls)
            cfg = dataclasses.replace(cfg, security=security)
        if not cfg.host:  # listen on, and advertise, this node's address
            cfg = dataclasses.replace(cfg, host=ray.util.get_node_ip_address())
        if hasattr(cfg, "kv_options"):  # its decode part's KV server listens there too
            cfg = dataclasses.replace(cfg, kv_options={"host": cfg.host, **cfg.kv_options})
        self._rank_actors(cfg)
        from pdserve.worker_common.start_stages import traced

        self.start_stages.begin()
        with traced(self.start_stages):
            self.worker = build_worker(self.role, cfg, self.flippable).start()
        self.start_stages.add("serving", f"{self.role} on {self.worker.address}")
        threading.Thread(target=self._exit_when_due, name="exit-watch", daemon=True).start()
        from pdserve.engine.precision import mode_headline

        return self.worker.address, mode_headline(self.worker.loop.engine.mode_note)

    def _rank_actors(self, cfg) -> None:
        """An engine of several ranks starts ranks 1..N-1 as Ray actors on the other bundles of
        this actor's placement group, where Ray placed them (deploy/rank_actors.py), not as child
        processes of this one."""
        kwargs = cfg.engine_kwargs
        ranks = kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1)
        if ranks > 1 and ray.util.get_current_placement_group() is not None:
            from pdserve.deploy.rank_actors import RayRanks
            from pdserve.engine.tp import use_launcher

            use_launcher(RayRanks(cfg.worker_id, self.cpus))

    def _exit_when_due(self) -> None:
        """The process exits when ExitWatch says so; the supervisor starts a fresh one."""
        import logging

        watch = ExitWatch()
        while (worker := self.worker) is not None:
            loop = worker.loop
            broken = (loop.broken or "") if loop is not None else ""
            unhealthy = "" if broken or loop is None else worker.unhealthy()
            busy = False
            if unhealthy:
                load = loop.load()
                busy = bool(load["num_running"] or load["num_waiting"])
            why = watch.reason(broken, unhealthy, busy, time.monotonic())
            if why:
                logging.getLogger(__name__).error(
                    "%s exits to be restarted: %s", self.worker_config.worker_id, why
                )
                os._exit(70)
            time.sleep(BROKEN_POLL_S)

    def stages(self, since: int = 0) -> list[tuple[float, str, str]]:
        """The start's stages after the first `since`: (seconds into the start, stage, text)."""
        return [(s.t, s.name, s.text) for s in self.start_stages.since(since)]

    def info(self) -> dict:
        """Where and how this started worker serves, as plain data (deploy/start_table.py's
        row): its node, cores, process and log file, its precision and its KV capacity."""
        from pdserve.deploy.rank_actors import rank_nodes
        from pdserve.worker_common.start_stages import kv_capacity

        engine = self.worker.loop.engine
        cfg = engine.config
        affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        cores = self.cpus or affinity
        context = ray.get_runtime_context()
        return dict(
            worker_id=self.worker_config.worker_id,
            role=self.worker.role,
            address=self.worker.address,
            node_ip=ray.util.get_node_ip_address(),
            node_id=context.get_node_id(),
            hostname=socket.gethostname(),
            pinned=bool(self.cpus),
            cores=list(cores),
            niceness=self.niceness,
            pid=os.getpid(),
            log_file=log_file(),
            device=cfg.device,
            dtype=cfg.dtype,
            quantization=cfg.quantization,
            kv_dtype=str(engine.runner.kv_cache.dtype).removeprefix("torch."),
            kv_backend=self._kv_backend(),
            tp=cfg.tensor_parallel_size,
            pp=cfg.pipeline_parallel_size,
            ranks=rank_nodes(engine),  # each rank's node, when they run as Ray actors
            **kv_capacity(
                engine.runner.num_blocks, cfg.block_size, cfg.max_model_len, cfg.max_num_seqs
            ),
        )

    def _kv_backend(self) -> str | None:
        """The start table's KV cell: the backend its decode part serves ("auto: shm, grpc" on
        auto), None for a worker without one."""
        decode = self.worker.parts.get("decode")
        if decode is not None and decode.kv_address is not None:
            return decode.kv_backends
        return getattr(self.worker_config, "kv_backend", None)

    def ping(self) -> bool:
        return self.worker is not None

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
