"""Launch a deployment on Ray: worker replicas as actors, the router in this (the driver) process.

    cluster = up(load_config("deploy/examples/local-cpu.yaml"), block=False)
    print(cluster.router_address)
    cluster.stop()

`pdserve up` calls `up`, which refuses a deployment that cannot run before it starts anything
(deploy/prechecks.py), then connects to Ray, starts the router, and starts every worker replica;
it returns once each replica has registered with the router, having logged each worker's start
stages as they came (deploy/start_watch.py); `Cluster.start_table()` is the table of where and how
each worker serves (deploy/start_table.py). The Cluster it returns serves until
Ctrl-C, SIGTERM or `stop()`, which undoes the start in reverse. Meanwhile its Supervisor
(deploy/supervisor.py) relaunches replicas whose actor died, and a pool with no live worker gets
UNAVAILABLE from the router. The router lives in the driver because it is the one client-facing
port: it should listen on the host the operator launched from and die with `pdserve up`, and it
holds no model, so it needs no Ray resources of its own. A local Ray that `up` starts dies with
it too, even when it is killed without a chance to stop it (deploy/ray_reaper.py).

Nothing of a default deployment listens beyond loopback: a local Ray binds to 127.0.0.1 unless
ray.bind is `all` (deploy/ray_connect.py), its workers and their KV servers listen on 127.0.0.1
(with ray.bind `all`, or on a cluster joined by address, on their node's address), and the router
on router.host (127.0.0.1 unless set). The secrets stay out of every environment: `up` takes
PDSERVE_CLUSTER_SECRET and PDSERVE_API_KEYS out of os.environ before Ray starts and gives them back
at stop; workers on this machine read the cluster secret from a 0600 file that lives as long as
the deployment (deploy/secret_files.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.deploy import ray_reaper, secret_files, start_table, workers
from pdserve.deploy.config.schema import DeployConfig, Pool
from pdserve.deploy.placement import check_custom_resources, check_labels, pg_options
from pdserve.deploy.prechecks import (  # noqa: F401
    DeployError,
    amounts,
    check_http_port_free,
    check_model_fit,
    check_port_free,
    check_resources,
    check_writable_dirs,
    cluster_security,
    cpus_gpus,
    local_ray_temp_dir,
)
from pdserve.deploy.ray_connect import check_dashboard, init_ray  # noqa: F401
from pdserve.deploy.start_watch import start_and_watch
from pdserve.deploy.supervisor import Replica, RestartPolicy, Supervisor, ray_error_reason, role_of  # noqa: F401
from pdserve.deploy.workers import WorkerActor
from pdserve.logs import console_level
from pdserve.protos.security import INSECURE, ClusterSecurity

log = logging.getLogger(__name__)


def core_plan(pools, local: bool) -> dict[tuple[str, int], list[int]]:
    """Cores of their own for each replica of a local deployment: (pool key, replica index) ->
    its num_threads x tp x pp cores, when all of them fit in this process's cores; else {} (no pinning).

    Left free to move, the compute threads of a prefill and a decode worker on 2 cores shared a
    core often enough to make the same sweep's SLO attainment vary widely from run to run, and
    pinning them narrowed that spread (docs/experiments/slo-validation.md, "Repeatability, and
    pinning the workers to cores"). The router and other threads stay free. Not for GPU pools,
    nor a Ray cluster given by address, whose nodes' cores this process cannot see."""
    if not local or not hasattr(os, "sched_getaffinity"):
        return {}
    cores = sorted(os.sched_getaffinity(0))
    plan: dict[tuple[str, int], list[int]] = {}
    used = 0
    for key, pool in pools:
        if pool.resources.num_gpus:
            return {}
        for i in range(pool.replicas):
            need = pool.threads * pool.ranks
            plan[(key, i)] = cores[used : used + need]
            used += need
    if used > len(cores):
        log.info(
            "not pinning workers to cores: they ask for %d compute threads, this machine "
            "has %d cores",
            used,
            len(cores),
        )
        return {}
    return plan


# Ray's own restarts re-run only __init__ (not start), at once and without a bound on quick
# deaths; the Supervisor replaces dead actors itself instead. A few threads: its `stages` and
# `ping` answer while `start` loads the model (deploy/start_watch.py)
RemoteWorker = ray.remote(max_restarts=0, max_concurrency=4)(WorkerActor)


@dataclass
class Cluster:
    config: DeployConfig
    started_ray: bool
    replicas: list[Replica] = field(default_factory=list)
    router: object = None
    router_address: str | None = None
    http_url: str | None = None  # the OpenAI-compatible HTTP front, e.g. http://127.0.0.1:8000
    registry_address: str | None = None  # the router as workers reach it
    security: ClusterSecurity = INSECURE  # its repr never shows the secret
    deployment_id: str = ""
    supervisor: Supervisor | None = None
    reaper: ray_reaper.Watchdog | None = None  # kills the local Ray we started if we die first
    # the cluster secret's 0600 file for the workers on this machine (None: in their config)
    secret_dir: secret_files.SecretDir | None = None
    withheld: secret_files.Withheld | None = None  # the secrets taken out of os.environ
    _stopped: bool = False

    def addresses(self, role: str) -> list[str]:
        return [r.address for r in self.replicas if r.role == role and r.address]

    def start_table(self) -> str:
        """Each worker as it started: node, cores, precision, KV backend and capacity, log file
        (deploy/start_table.py)."""
        colocated = self.config.pools.colocated is not None
        infos = [r.info or {"worker_id": r.name, "role": r.role} for r in self.replicas]
        if colocated:
            return start_table.format_table(infos, "none (colocated)")
        ranking = None
        if self.config.kvtransfer.backend == "auto":
            ranking = self.config.kvtransfer.ranking()
        rule = _local_prefill(self.config).describe()
        planner = self.config.planner
        if planner.enabled and planner.local_cap:
            rule += f"; the planner may raise max_prompt_tokens to {planner.local_cap}"
        if self.config.router.local_prefill.cost == "auto":
            pools = self.config.pools
            rule += (
                f" (auto: a prefill worker's tp x devices {pools.prefill.compute:g} over a "
                f"decode worker's {pools.decode.compute:g})"
            )
        return start_table.format_table(infos, ranking=ranking, local_prefill=rule)

    def wait(self, poll_s: float = 1.0) -> str:
        """Serves until Ctrl-C or SIGTERM, then stops the deployment; returns why ("interrupted"
        or "SIGTERM"). Dead workers are replaced meanwhile, and not even an empty pool stops it
        (see Supervisor). On the main thread both signals are handled (no KeyboardInterrupt
        lands inside threading's locks, which turned a Ctrl-C beside a SIGTERM into a
        RuntimeError traceback), and a second one while the deployment stops is logged and
        ignored, so the teardown finishes."""
        done = threading.Event()
        why: list[str] = []

        def on_signal(signum, _frame):
            if why:
                log.info("already stopping: the deployment's teardown goes on")
                return
            why.append("interrupted" if signum == signal.SIGINT else "SIGTERM")
            done.set()

        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {
                sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
            }
        try:
            while not done.wait(poll_s):
                pass
        except KeyboardInterrupt:  # (off the main thread Python raises it where it may)
            why.append("interrupted")
        finally:
            reason = why[0] if why else "SIGTERM"
            t0 = time.perf_counter()
            log.info("stopping (%s)", "Ctrl-C" if reason == "interrupted" else reason)
            try:
                self.stop()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
            log.info("stopped in %.1fs", time.perf_counter() - t0)
        return reason

    def stop(self, timeout_s: float = 30.0) -> None:
        """Supervisor (no more relaunches), router (no new requests), then the workers (each
        asked to stop, all within timeout_s together, then killed), their placement groups, and
        Ray if we started it. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.router is not None:
            try:
                self.router.stop()
            except Exception:
                log.exception("router stop failed")
            self.router = None
        # an actor never asked to start has only imported: killed at once, not asked to stop
        # (the call would wait for its constructor, up to timeout_s, on a start Ctrl-C cut short)
        pending = [
            (r, r.actor.stop.remote())
            for r in self.replicas
            if r.actor is not None and r.asked_to_start
        ]
        # one deadline for all: a replica whose start a Ctrl-C cut short answers only once its
        # start returns, and waiting timeout_s for each in turn made a stop take that long times
        # the replicas
        deadline = time.monotonic() + timeout_s
        for r, ref in pending:
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except Exception as e:  # it is killed next regardless
                log.warning("%s did not stop cleanly: %s", r.name, ray_error_reason(e))
        for r in self.replicas:
            if r.actor is not None:
                ray.kill(r.actor)
                r.actor = None
            remove_placement_group(r.pg)
        self.replicas.clear()
        if self.started_ray:
            ray.shutdown()
        if self.reaper is not None:
            self.reaper.stop()
            self.reaper = None
        if self.secret_dir is not None:
            self.secret_dir.remove()
            self.secret_dir = None
        if self.withheld is not None:
            self.withheld.restore()
            self.withheld = None


# ---- starting ------------------------------------------------------------------------------------
def _worker_config(cluster: Cluster, key: str, pool: Pool, index: int, host: str):
    config = cluster.config
    security = cluster.security
    if cluster.secret_dir is not None:  # the worker reads the secret (and TLS key) from files
        tls = security.tls and dataclasses.replace(security.tls, key_pem=b"")
        security = ClusterSecurity(None, tls)
    common = dict(
        model=config.model,
        model_id=config.served_model_id(),
        engine_kwargs=config.engine_kwargs(pool),
        host=host,
        port=0,
        worker_id=f"{key}-{index}",
        security=security,
        deployment_id=cluster.deployment_id,
        otlp_traces_endpoint=_traces_endpoint(config),
        trace_sample_ratio=config.observability.trace_sample_ratio,
        log_level=console_level(config.observability)[0],
        log_format=config.observability.log_format,
    )
    ranking = None
    if config.kvtransfer.backend == "auto":
        ranking = config.kvtransfer.ranking().to_dict()
    return workers.worker_config(
        common, role_of(key), config.kvtransfer.backend, _flippable(config, pool), ranking
    )


def _traces_endpoint(config: DeployConfig) -> str | None:
    """The OTLP endpoint every process exports its spans to (protos/tracing.py): the flag's or
    the key's, else this environment's OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (workers on other
    nodes do not share `up`'s environment, so it travels in their config)."""
    from pdserve.protos.tracing import ENDPOINT_ENV

    return config.observability.otlp_traces_endpoint or os.environ.get(ENDPOINT_ENV) or None


def _flippable(config: DeployConfig, pool: Pool) -> bool:
    """Whether `pool`'s workers carry both roles (deploy/workers.py): all but colocated ones and
    those that run in pipeline stages (a decode worker runs in one)."""
    return config.pools.colocated is None and pool.pp == 1


def _spawner(
    r: Replica,
    pool: Pool,
    worker_config,
    cpus: list[int] | None,
    flippable: bool,
    secret_file: str | None = None,
) -> Callable[[], object]:
    def spawn():
        return RemoteWorker.options(
            name=r.name,  # `ray list actors` shows decode-0, prefill-1, ...
            num_cpus=pool.resources.num_cpus,
            num_gpus=pool.resources.num_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=r.pg, placement_group_bundle_index=0
            ),
        ).remote(r.role, worker_config, pool.threads, cpus, flippable, secret_file)

    return spawn


def _place_pool(
    cluster: Cluster,
    key: str,
    pool: Pool,
    host: str,
    ready_timeout_s: float,
    cores: dict[tuple[str, int], list[int]],
) -> None:
    """Reserves a placement group per replica and creates its actor (not yet serving)."""
    bundle = pool.resources.bundle()
    new = []
    for i in range(pool.replicas):
        # one placement group per replica, a bundle per rank: a one-stage worker's ranks on one
        # node together, a pipelined one's on as few nodes as hold them, nodes with the pool's
        # custom resources and labels (deploy/placement.py)
        pg = placement_group(**pg_options(pool), name=f"pdserve-{key}-{i}")
        new.append(Replica(key, i, pg))
        cluster.replicas.append(new[-1])
    for r in new:
        try:
            ray.get(r.pg.ready(), timeout=ready_timeout_s)
        except ray.exceptions.GetTimeoutError:  # it fits the cluster (check_resources): busy
            raise DeployError(
                f"pools.{key}: replica {r.index} could not reserve {pool.ranks} x {amounts(bundle)} "
                f"within {ready_timeout_s:.0f}s; the Ray cluster has "
                f"{amounts(_of(bundle, ray.available_resources()))} free of "
                f"{amounts(_of(bundle, ray.cluster_resources()))}, the rest held by others: free "
                f"it, or lower pools.{key}.replicas or resources"
            ) from None
        cfg = _worker_config(cluster, key, pool, r.index, host)
        secret_file = cluster.secret_dir.secret_file if cluster.secret_dir else None
        r.spawn = _spawner(
            r, pool, cfg, cores.get((key, r.index)), _flippable(cluster.config, pool), secret_file
        )
        r.actor = _first_spawn(r)


def _first_spawn(r: Replica, timeout_s: float = 10.0):
    """r.spawn(), retried while its name is held: ray.kill frees a stopped deployment's actor
    names a moment later, and a driver may start one deployment after another."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return r.spawn()
        except ValueError as e:
            if "already taken" not in str(e):
                raise
            if time.monotonic() > deadline:
                raise DeployError(
                    f"pools.{r.key}: a Ray actor named {r.name} is alive in this driver's Ray "
                    f"namespace (another deployment started by this process?); stop it first"
                ) from None
            time.sleep(0.1)


def _of(bundle: dict, resources: dict) -> dict:
    """The amounts of `resources` (a Ray total) for the resources `bundle` asks for."""
    return {k: resources.get(k, 0) for k in bundle} or cpus_gpus(resources)


def client_keys(config: DeployConfig, environ=os.environ) -> tuple[str, ...]:
    """The client API keys (router.api_keys_file, router.api_keys, PDSERVE_API_KEYS: first found
    wins); logs where they came from and how many, never the keys."""
    from pdserve.deploy.config.load import ConfigError

    try:
        keys, source = config.router.client_keys(environ)
    except ValueError as e:  # the environment's keys are only checked here
        raise ConfigError(str(e)) from None
    if keys:
        log.info("client API keys: %d from %s", len(keys), source)
    else:
        log.info("client API keys: none (the client API is open to anyone who can reach it)")
    return keys


def _start_router(cluster: Cluster, api_keys: tuple[str, ...] = ()) -> None:
    """The router with empty pools: workers join through its Registry service as they start."""
    from pdserve.planner.policy import PlannerConfig
    from pdserve.router.server import (  # imported late: the router is optional to the rest
        Router,
        RouterConfig,
    )

    config = cluster.config
    lens = [p.max_model_len for _, p in config.worker_pools() if p.max_model_len]
    router_config = RouterConfig(
        model=config.model,
        chat_template=config.chat_template,
        generation_config=config.generation_config,
        override_generation_config=tuple(config.override_generation_config.items()),
        classifier_from_token=tuple(config.hf_overrides.classifier_from_token or ()),
        matryoshka=_matryoshka(config.hf_overrides),
        model_id=config.served_model_id(),
        model_aliases=config.served_model_aliases(),
        lora_enabled=config.lora.enabled,
        lora_modules=tuple(config.lora.modules.items()),
        lora_allow_runtime_updates=config.lora.allow_runtime_updates,
        pause_endpoints=config.router.pause_endpoints,
        weight_updates=config.router.weight_updates,
        sleep_mode=config.router.sleep_mode,
        host=config.router.host,
        colocated=config.pools.colocated is not None,
        port=config.router.port,
        max_inflight=config.router.max_inflight,
        max_queued=config.router.max_queued,
        max_queue_wait_s=config.router.max_queue_wait_s,
        scheduling_policy=config.router.scheduling_policy,
        embedding_pooling=config.router.embedding_pooling,
        embedding_normalize=config.router.embedding_normalize,
        decode_queue_timeout_s=config.router.decode_queue_timeout_s,
        stream_interval=config.router.stream_interval,
        worker_down_s=config.router.worker_down_s,
        worker_silence_s=config.router.worker_silence_s,
        worker_stall_s=config.router.worker_stall_s,
        worker_stall_factor=config.router.worker_stall_factor,
        flip_drain_s=config.router.flip_drain_s,
        reconcile_bound_s=config.router.reconcile_bound_s,
        local_prefill=_local_prefill(config),
        peer_fetch=_peer_fetch(config),
        planner=PlannerConfig(**config.planner.model_dump(exclude={"enabled"}))
        if config.planner.enabled
        else None,
        max_model_len=min(lens) if lens else None,  # what every worker on the path can hold
        dtype=None if config.dtype == "auto" else config.dtype,
        security=cluster.security,
        deployment_id=cluster.deployment_id,
        client_tls=config.router.tls.tls_config() if config.router.tls else None,
        http_port=config.router.http_port,
        http_header_timeout_s=config.router.http_header_timeout_s,
        http_body_timeout_s=config.router.http_body_timeout_s,
        http_max_connections=config.router.http_max_connections,
        http_responses_store_bytes=config.router.responses_store_mb << 20,
        http_files_store_bytes=config.router.files_store_mb << 20,
        http_files_dir=config.router.files_dir,
        http_batch_max_inflight=config.router.batch_max_inflight,
        http_cors_allowed_origins=tuple(config.router.cors_allowed_origins),
        http_allowed_media_domains=tuple(config.router.allowed_media_domains),
        max_images=config.router.max_images(),
        mm_processor_kwargs=dict(config.router.mm_processor_kwargs),
        api_keys=api_keys,
        metrics_keys=config.router.metrics_keys(),
        console_stats_interval_s=config.observability.stats_interval_s,
        capture_trace=config.observability.capture_trace,
        otlp_traces_endpoint=_traces_endpoint(config),
        trace_sample_ratio=config.observability.trace_sample_ratio,
        capture_max_bytes=config.observability.capture_max_mb << 20,
    )
    cluster.router = Router(router_config).start()
    cluster.router_address = cluster.router.address
    if cluster.router.http is not None:
        cluster.http_url = f"{cluster.router.http.scheme}://{cluster.router.http_address}"
    host, _, port = cluster.router_address.rpartition(":")
    if host in ("0.0.0.0", "", "[::]"):  # listening everywhere: workers reach it at this node's IP
        host = ray.util.get_node_ip_address()
    cluster.registry_address = f"{host}:{port}"


def _peer_fetch(config):
    """The router's peer-fetch settings (router/peer_fetch.py); off where a pool keeps no prefix
    cache (the decode side has none to serve, or the prefill side none to install into)."""
    from pdserve.router.peer_fetch import PeerFetch  # imported late, as the router

    settings = config.router.peer_fetch.model_dump()
    pools = [p for k, p in config.worker_pools() if k in ("decode", "prefill")]
    if not all(p.enable_prefix_caching for p in pools):
        settings["enabled"] = False
    return PeerFetch(**settings)


def _matryoshka(overrides) -> bool | tuple[int, ...] | None:
    """RouterConfig.matryoshka from the YAML's hf_overrides (None: as the model's config says)."""
    if overrides.matryoshka_dimensions:
        return tuple(overrides.matryoshka_dimensions)
    return overrides.is_matryoshka


def _local_prefill(config):
    """The router's LocalPrefill rule; a conversation's turns are routed back to the decode
    worker that holds them only where the decode workers keep a prefix cache (reuse needs it).
    cost "auto" is a prefill worker's compute over a decode worker's (Pool.compute): a prompt
    token costs the same on either where the workers are alike, as in the local layouts."""
    from pdserve.planner.local_prefill import LocalPrefill  # imported late, as the router

    settings = config.router.local_prefill.model_dump()
    pools = dict(config.worker_pools())
    decode = [p for k, p in pools.items() if k in ("decode", "colocated")]
    if not all(p.enable_prefix_caching for p in decode):
        settings["reuse_max_new_tokens"] = 0
    if settings["cost"] == "auto":
        both = "prefill" in pools and "decode" in pools
        settings["cost"] = pools["prefill"].compute / pools["decode"].compute if both else 1.0
    return LocalPrefill(**settings)


def on_one_machine(nodes: list[dict]) -> bool:
    """Whether every live Ray node is on this process's machine (has this node's IP, as Ray's
    nodes started on one host do), so that a file written here is there for every worker."""
    here = ray.util.get_node_ip_address()
    return bool(nodes) and all(n.get("NodeManagerAddress") == here for n in nodes)


def _wait_registered(cluster: Cluster, timeout_s: float) -> None:
    pool = cluster.router.pool
    deadline = time.monotonic() + timeout_s
    for key, spec in cluster.config.worker_pools():
        role, want = role_of(key), spec.replicas
        while pool.num_workers(role) < want:
            if time.monotonic() > deadline:
                raise DeployError(
                    f"pools.{key}: {pool.num_workers(role)} of {want} replicas "
                    f"registered with the router within {timeout_s:.0f}s; can the "
                    f"workers reach {cluster.registry_address}? (router.host)"
                )
            time.sleep(0.05)


def _connect(config: DeployConfig, address: str | None, security: ClusterSecurity) -> Cluster:
    """Ray, connected to (or started) with the secrets out of os.environ (they would be inherited
    by Ray's processes: deploy/secret_files.py), and the Cluster that undoes both at stop."""
    withheld = secret_files.withhold_from_environment()
    try:
        started, reaper = init_ray(config, address)
    except BaseException:
        withheld.restore()
        raise
    return Cluster(
        config,
        started,
        security=security,
        deployment_id=uuid.uuid4().hex,
        reaper=reaper,
        withheld=withheld,
    )


def _start_on_ray(
    cluster: Cluster,
    api_keys,
    security: ClusterSecurity,
    host: str,
    local: bool,
    ready_timeout_s: float,
    start_timeout_s: float,
) -> None:
    """up()'s steps once Ray runs: the resource checks against the cluster Ray reports, every
    pool's replicas placed (their actors created), the router, then every replica started at
    once, until each has registered."""
    config = cluster.config
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if security.secret and on_one_machine(alive):  # workers here read the secret's file
        tls_key = security.tls.key_pem if security.tls else None
        cluster.secret_dir = secret_files.SecretDir(security.secret, tls_key=tls_key)
    nodes = [n["Resources"] for n in alive]
    check_custom_resources(config, ray.cluster_resources(), local)
    check_resources(config, ray.cluster_resources(), nodes, local)
    check_labels(config, ray.nodes())
    pools = config.worker_pools()
    cores = core_plan(pools, local)
    # every actor first: their processes spawn and import (torch, the engine) in parallel with
    # each other and with the router's start here; each learns the router's address at start()
    for key, pool in pools:
        _place_pool(cluster, key, pool, host, ready_timeout_s, cores)
    _start_router(cluster, api_keys)
    start_and_watch(cluster.replicas, cluster.registry_address, start_timeout_s)
    _wait_registered(cluster, ready_timeout_s)


class _TermStopsStart:
    """While the deployment starts, SIGTERM stops the start as Ctrl-C does: a KeyboardInterrupt in
    the main thread, so the start is undone in reverse and `pdserve up` exits 130 (without this,
    Ray's driver handler exits with the signal's number after its C++ handler prints a stack).
    A second SIGTERM while the start is being undone is ignored; the previous handler is put back
    at the end. Outside the main thread (where Python cannot set handlers) it does nothing."""

    def __enter__(self):
        self.previous = None
        self.sent = False
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._interrupt)
        return self

    def _interrupt(self, *_):
        if not self.sent:
            self.sent = True
            raise KeyboardInterrupt("SIGTERM")

    def __exit__(self, *_):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def _import_router_ahead(config: DeployConfig) -> threading.Thread:
    """Imports the router's modules (torch and transformers among them, which its tokenizer
    needs) on a thread of their own while this thread checks the deployment and Ray starts: a
    local Ray's start is mostly waiting on its own processes, and the imports would otherwise
    come after it, on the deployment's critical path. Whatever fails here fails again, with its
    traceback, where the router is built."""

    def run():
        try:
            import pdserve.router.server  # noqa: F401

            if config.router.http_port is not None:
                import pdserve.router.openai.server  # noqa: F401
        except Exception:  # raised again at _start_router, on the main thread
            log.debug("importing the router ahead failed", exc_info=True)

    thread = threading.Thread(target=run, name="pdserve-router-imports", daemon=True)
    thread.start()
    return thread


def up(
    config: DeployConfig,
    address: str | None = None,
    block: bool = True,
    *,
    ready_timeout_s: float = 120.0,
    start_timeout_s: float = 600.0,
    restart: RestartPolicy = RestartPolicy(),
    environ=os.environ,
) -> Cluster:
    """Starts the deployment described by `config` and returns it; with block=True, serves until
    Ctrl-C or SIGTERM and stops before returning. `address` overrides config.ray.address;
    `environ` is where PDSERVE_CLUSTER_SECRET and PDSERVE_API_KEYS are looked up.

    Refused at once, before Ray starts: a router port something already listens on, and pools
    that do not fit the model (TP must divide the heads, one max_model_len sequence must fit the
    KV cache); right after connecting to Ray: pools the cluster's resources cannot hold. Each
    refusal is a ConfigError or DeployError naming the key to change; so is a worker that fails
    to start. Then: for each replica one placement group (`tp x pp` bundles, one node for a TP
    group, stages may spread: placement.py; rank 0 in the actor, ranks 1..N-1 Ray actors:
    rank_actors.py) and its actor, which imports while the router starts (with empty pools, a
    fresh deployment_id and the cluster secret); every pool's actors started at once, each
    registered with the router under the same secret and deployment_id. Ctrl-C or SIGTERM while
    it starts undoes the start and raises KeyboardInterrupt."""
    on_this_machine = not (address or config.ray.address)
    _import_router_ahead(config)
    check_port_free(config.router.host, config.router.port)
    check_http_port_free(config)
    api_keys = client_keys(config, environ)
    check_writable_dirs(config, on_this_machine, on_this_machine and not ray.is_initialized())
    check_model_fit(config, on_this_machine)
    if (
        on_this_machine and not ray.is_initialized()
    ):  # a local Ray's CPUs are known before it starts
        cpus = float(config.ray.num_cpus or os.cpu_count() or 1)
        gpus = sum(p.replicas * p.ranks * p.resources.num_gpus for _, p in config.worker_pools())
        # GPUs: as many as asked (Ray finds the real number: checked again once it runs)
        check_resources(
            config, {"CPU": cpus, "GPU": gpus}, [{"CPU": cpus, "GPU": gpus}], local=True
        )
    security = cluster_security(config, environ)
    if on_this_machine:  # the workers' engines pick their paths from it (engine/cpu.py)
        from pdserve.engine.cpu import cpu_features

        log.info("this machine's CPU: %s", cpu_features().describe())
    t0 = time.perf_counter()
    cluster = _connect(config, address, security)
    # a local Ray runs everything on this machine: loopback is reachable and opens no ports
    # (ray.bind all: the workers listen on the node's address, as on a joined cluster)
    local = cluster.started_ray and on_this_machine
    host = "127.0.0.1" if local and config.ray.bind == "loopback" else ""
    with _TermStopsStart() as term:  # SIGTERM from here on: the start undone, as on Ctrl-C
        try:
            log.info("ray ready in %.1fs", time.perf_counter() - t0)
            timeouts = (ready_timeout_s, start_timeout_s)
            _start_on_ray(cluster, api_keys, security, host, local, *timeouts)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):  # (code between may raise one of its own)
                why = "SIGTERM" if term.sent else "Ctrl-C"
                log.info("start interrupted (%s): stopping what started", why)
            cluster.stop()
            raise
    cluster.supervisor = Supervisor(cluster.replicas, restart, cluster.registry_address).start()
    log.info(
        "deployment %s up in %.1fs; router on %s%s",
        cluster.deployment_id,
        time.perf_counter() - t0,
        cluster.router_address,
        f", OpenAI-compatible HTTP on {cluster.http_url}" if cluster.http_url else "",
    )
    if block:
        cluster.wait()
    return cluster
