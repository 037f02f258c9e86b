"""Checks `pdserve up` makes before it waits on anything: the router's port, the directories it
writes on this machine (pdserve's cache, a local Ray's temp dir), the pools against the model, the
pools against Ray's resources, and the cluster secret. Each refusal is a ConfigError or a
DeployError whose one-line message names the key (or environment variable) to change."""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import secrets
import socket

from pdserve.deploy.config import SECRET_ENV, ConfigError, DeployConfig
from pdserve.deploy.config_checks import fit_problems, placement_problems
from pdserve.protos.security import ClusterSecurity

log = logging.getLogger("pdserve.deploy.launcher")


class DeployError(RuntimeError):
    """The deployment cannot start as configured; the message names the pool or key to change."""


def check_port_free(host: str, port: int) -> None:
    """Refuses a router port something already listens on. gRPC alone would not: it binds with
    SO_REUSEPORT, so a second router on a busy port starts anyway and the kernel splits the
    connections, and the workers' registrations, between the two. A probe without SO_REUSEPORT
    cannot bind beside any listener; SO_REUSEADDR (as gRPC sets) still lets it past connections
    in TIME_WAIT from a router that just stopped."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise DeployError(
            f"router.host: cannot resolve {host!r} ({e.strerror}); set it to an "
            f"address of this machine"
        ) from None
    failures = []
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise DeployError(
                        f"router.port: {host}:{port} is already in use (another "
                        f"pdserve up?); stop that, or set router.port to a free "
                        f"port (0 picks one)"
                    ) from None
                failures.append(e)
    if failures and len(failures) == len(infos):  # gRPC needs one of the addresses
        raise DeployError(
            f"router: cannot listen on {host}:{port} ({failures[0].strerror}); set "
            f"router.host to an address of this machine and router.port to a port "
            f"you may open"
        )


def local_ray_temp_dir(config: DeployConfig) -> pathlib.Path:
    """Where a local Ray of this deployment keeps its files: ray.temp_dir, else `ray` in pdserve's
    cache (a private one keeps it off the machine-wide /tmp/ray; the Unix socket paths under it
    must stay short, which the cache's are)."""
    from pdserve.engine.loader import default_cache_dir

    return pathlib.Path(config.ray.temp_dir or default_cache_dir() / "ray").absolute()


def check_writable_dirs(config: DeployConfig, on_this_machine: bool, local_ray: bool) -> None:
    """Refuses directories `up` would write on this machine but cannot: the compiled CPU kernels'
    (`kernels` in pdserve's cache) when a pool runs on CPU with the kernels on, and a local Ray's
    temp dir (`local_ray_temp_dir`). A model converted into the cache is checked where it is
    converted (engine/loader/resolve.py, through check_model_fit). Else the first of them to fail
    would end `up` in a traceback (Ray's), or leave every worker on the slow torch path with
    nothing but a line in its own log."""
    from pdserve.engine.loader import CacheDirError, default_cache_dir, writable_dir

    dirs = []  # (directory, the fix when it is not the cache's, what else would do)
    cpu_pools = any(not p.resources.num_gpus for _, p in config.worker_pools())
    if on_this_machine and cpu_pools and os.environ.get("PDSERVE_CPU_KERNELS", "1") != "0":
        also = " (or PDSERVE_CPU_KERNELS=0 to run without the compiled CPU kernels)"
        dirs.append((default_cache_dir() / "kernels", None, also))
    if local_ray and config.ray.temp_dir:
        fix = "set ray.temp_dir to a directory you can write"
        dirs.append((local_ray_temp_dir(config), fix, ""))
    elif local_ray:
        dirs.append((local_ray_temp_dir(config), None, " (or ray.temp_dir for Ray's files)"))
    for path, fix, also in dirs:
        try:
            writable_dir(path, fix)
        except CacheDirError as e:
            raise DeployError(f"{e}{also}") from None


def check_model_fit(config: DeployConfig, on_this_machine: bool = True) -> None:
    """Refuses, before anything starts, pools whose workers would refuse the model
    (config_checks.fit_problems); else every replica of the pool would fail the same way inside
    its actor. A model that needs converting into a cache this process cannot write is refused
    as DeployError (the router, in this process, reads its tokenizer from there too)."""
    from pdserve.engine.config import available_memory_bytes
    from pdserve.engine.loader import CacheDirError, load_hf_config, resolve_model

    try:
        model_dir = resolve_model(config.model)
    except CacheDirError as e:
        raise DeployError(str(e)) from None
    except ValueError as e:
        if on_this_machine:
            raise ConfigError("\n".join([str(e)] + placement_problems(config))) from None
        log.warning(
            "not checking the pools against the model: %s (the workers load it on their nodes)", e
        )
        if placement_problems(config):  # refused whatever the model
            raise ConfigError("\n".join(placement_problems(config))) from None
        return
    memory = available_memory_bytes("cpu") if on_this_machine else None
    problems = fit_problems(config, load_hf_config(model_dir), memory)
    if problems:
        raise ConfigError("\n".join(problems))


def amounts(resources: dict) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items()) if v) or "nothing"


def cpus_gpus(resources: dict) -> dict:
    return {k: resources.get(k, 0) for k in ("CPU", "GPU") if resources.get(k)}


def check_resources(config: DeployConfig, total: dict, nodes: list[dict], local: bool) -> None:
    """Refuses at once pools the Ray cluster could not hold even when idle, rather than waiting for
    placement groups that can never be placed: every replica together against the cluster's
    `total`, then each TP group (STRICT_PACK: one node) against the largest of `nodes`."""
    need, asks = {}, []
    for key, pool in config.worker_pools():
        bundle = pool.resources.bundle()
        for k, v in bundle.items():
            need[k] = need.get(k, 0) + v * pool.tp * pool.replicas
        asks.append(f"{key} {pool.replicas} x tp {pool.tp} x {amounts(bundle)}")
    short = [k for k, v in sorted(need.items()) if v > total.get(k, 0) + 1e-9]
    if short:
        more = "raise ray.num_cpus" if local and "CPU" in short else "add Ray nodes"
        raise DeployError(
            f"the pools ask for {amounts(need)} ({'; '.join(asks)}) but the Ray cluster has "
            f"{amounts({k: total.get(k, 0) for k in need})}: lower pools.<pool>.replicas, .tp or "
            f".resources.num_{short[0].lower()}s, or {more}"
        )
    for key, pool in config.worker_pools():
        bundle = pool.resources.bundle()
        group = {k: v * pool.tp for k, v in bundle.items()}
        if nodes and not any(all(n.get(k, 0) >= v for k, v in group.items()) for n in nodes):
            biggest = max(nodes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)))
            raise DeployError(
                f"pools.{key}: one replica needs {amounts(group)} on one node (tp "
                f"{pool.tp} x {amounts(bundle)}); the largest Ray node has "
                f"{amounts(cpus_gpus(biggest))}: lower pools.{key}.tp or "
                f"pools.{key}.resources"
            )


def cluster_security(config: DeployConfig, environ=os.environ) -> ClusterSecurity:
    """The deployment's ClusterSecurity: its secret as config.SecuritySettings.secret finds it,
    else a fresh one (every process gets it from `up`, so nobody else needs to know it)."""
    secret, source = config.security.secret(environ)
    if secret is None:
        secret, source = secrets.token_urlsafe(32), "a fresh one for this deployment"
    elif source != SECRET_ENV and environ.get(SECRET_ENV):
        log.warning("%s is set, but %s wins over it", SECRET_ENV, source)
    try:
        security = config.security.cluster_security(secret)
    except ValueError as e:  # too short: only the environment's is not checked at load
        raise DeployError(f"{source}: {e}") from None
    log.info("cluster secret: %s", source)
    return security


def check_offline(config: DeployConfig, address: str | None = None) -> list[str]:
    """`pdserve up --check`: the refusals `up` makes before Ray starts, bar the router port (a
    check of this moment, not of the config): the directories it writes here
    (check_writable_dirs), the pools against the model (fit_problems; a model that is not on this
    machine is checked for the placement only, its workers load it on their nodes) and, for a
    local Ray, the pools against its CPUs. Returns the notes on what was not checked; raises
    ConfigError or DeployError on a refusal."""
    on_this_machine = not (address or config.ray.address)
    from pdserve.engine.loader import CacheDirError, resolve_model

    check_writable_dirs(config, on_this_machine, local_ray=on_this_machine)
    notes = []
    try:
        resolve_model(config.model)
    except CacheDirError as e:
        raise DeployError(str(e)) from None
    except ValueError as e:
        notes.append(f"the pools were not checked against the model: {e}")
        if placement_problems(config):  # refused whatever the model
            raise ConfigError("\n".join(placement_problems(config))) from None
    else:
        check_model_fit(config, on_this_machine)
    if on_this_machine:
        cpus = float(config.ray.num_cpus or os.cpu_count() or 1)
        gpus = sum(p.replicas * p.tp * p.resources.num_gpus for _, p in config.worker_pools())
        check_resources(
            config, {"CPU": cpus, "GPU": gpus}, [{"CPU": cpus, "GPU": gpus}], local=True
        )
    else:
        notes.append("the pools were not checked against the Ray cluster's resources (not joined)")
    notes.append(f"router port {config.router.address} not probed (checked by `pdserve up`)")
    return notes
