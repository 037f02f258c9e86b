"""Checks `pdserve up` makes before it waits on anything: the model on this machine, the router's
ports, the settings the environment gives, the directories it writes on this machine (pdserve's
cache, a local Ray's temp dir), the pools against Ray's resources and against the model, and the
cluster secret. Each refusal is a ConfigError or a DeployError whose one-line message names the key
(or environment variable) to change.

`preflight` runs them in one order for both `pdserve up` and `pdserve up --check` (pdserve/cli.py),
so the two stop at the same first refusal; nothing here starts Ray, binds a port for longer than a
probe, or loads weights (a GGUF model is converted into the cache once, as the workers would).
What cannot be known before the workers start, `preflight` returns as notes, which `--check`
prints. After Ray has started, the launcher (deploy/launcher.py) calls check_resources again with
the resources the cluster reports, the only check a cluster joined by address gets before its
workers start. Nothing here keeps state between calls.
"""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import secrets
import socket

from pdserve.deploy.config.checks import fit_problems, placement_problems
from pdserve.deploy.config.files import SECRET_ENV
from pdserve.deploy.config.load import ConfigError
from pdserve.deploy.config.schema import DeployConfig
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
    (config/checks.py fit_problems), and on this machine workers whose weights and KV caches need
    more memory than is free (memory_problems); else every replica of the pool would fail the
    same way inside its actor. A model that needs converting into a cache this process cannot write is refused
    as DeployError (the router, in this process, reads its tokenizer from there too)."""
    from pdserve.engine.loader import CacheDirError, resolve_model

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
    from pdserve.engine.config import available_memory_bytes  # these import torch
    from pdserve.engine.loader import load_hf_config

    memory = available_memory_bytes("cpu") if on_this_machine else None
    hf = load_hf_config(model_dir)
    problems = fit_problems(config, hf, memory)
    if not problems and memory is not None:
        problems = memory_problems(config, hf, memory)
    if problems:
        raise ConfigError("\n".join(problems))


def _weight_itemsize(config: DeployConfig) -> float:
    """A lower bound on the bytes per weight a worker holds while it starts: every linear's dense
    weight is allocated in the activations' dtype and loaded before a quantization mode packs it,
    so int8, int4 and "auto" hold less once started, not while loading (an 822 MB float32 Mixtral
    shape peaked at 2.2 GB under int4 and settled at 0.6). 4 for float32 (a CPU pool's "auto"
    dtype), else 2."""
    return 4 if config.dtype in ("float32", "fp32", "auto") else 2


def stage_weight_bytes(hf: dict, tp: int, pp: int, itemsize: float) -> list[int]:
    """The weights one rank of each pipeline stage holds, stage order, estimated from the model's
    config.json: its stage's decoder layers (engine/parallel.py stage_layers) split over tp ranks,
    every expert of a mixture-of-experts layer counted (`mlp_params`), and on the first stage the
    embedding, the final norm and the LM head (engine/tp.py)."""
    from pdserve.engine.parallel import stage_layers

    hf = hf.get("text_config", hf)
    h, layers = hf["hidden_size"], hf["num_hidden_layers"]
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or h // heads
    vocab = hf.get("vocab_size") or 0
    attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim + 2 * h
    head = vocab * h * (1 if hf.get("tie_word_embeddings") else 2) + h
    sizes = []
    for stage in range(pp):
        first, end = stage_layers(layers, stage, pp)
        params = sum(attention + mlp_params(hf, i) for i in range(first, end))
        params += head if stage == 0 else 0
        sizes.append(int(params * itemsize / tp))
    return sizes


def mlp_params(hf: dict, layer: int) -> int:
    """The parameters of decoder layer `layer`'s MLP: a dense one's, or in a mixture-of-experts
    layer every routed expert's, the shared experts' and the router's, under the config keys of
    the families the engine serves (Mixtral's and gpt-oss's num_local_experts, Qwen's num_experts,
    DeepSeek's and GLM's n_routed_experts; their dense layers as engine/models reads them)."""
    h = hf["hidden_size"]
    dense = hf.get("intermediate_size") or 4 * h
    experts = (
        hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts") or 0
    )
    if not experts or not _sparse_layer(hf, layer):
        return 3 * h * dense
    inter = hf.get("moe_intermediate_size") or dense
    shared = hf.get("shared_expert_intermediate_size") or (hf.get("n_shared_experts") or 0) * inter
    return 3 * h * inter * experts + 3 * h * shared + h * experts


def _sparse_layer(hf: dict, layer: int) -> bool:
    """Whether a mixture-of-experts model's layer is sparse: GLM-4.7 Flash's mlp_layer_types,
    DeepSeek's first_k_dense_replace dense layers, Qwen-MoE's mlp_only_layers and
    decoder_sparse_step; every layer of the others."""
    types = hf.get("mlp_layer_types")
    if types:
        return types[layer] == "sparse"
    if layer < (hf.get("first_k_dense_replace") or 0) or layer in (hf.get("mlp_only_layers") or ()):
        return False
    return (layer + 1) % (hf.get("decoder_sparse_step") or 1) == 0


def memory_problems(config: DeployConfig, hf: dict, memory: int) -> list[str]:
    """Refuses deployments whose workers on this machine (a local Ray: every rank of every pool
    here) need more memory than `memory` (free bytes) for their weights and KV caches: each rank
    holds its stage's share of the weights (stage_weight_bytes, a lower bound) and a KV cache of
    kv_cache_memory bytes (a fraction of free memory is not counted: the engine takes it of
    what is free when it starts). GPU pools are not counted."""
    total, shares = 0, []
    for key, pool in config.worker_pools():
        if pool.resources.num_gpus:
            continue
        weights = stage_weight_bytes(hf, pool.tp, pool.pp, _weight_itemsize(config))
        kv = pool.kv_cache_memory if isinstance(pool.kv_cache_memory, int) else 0
        if pool.kv_cache_memory is None:
            from pdserve.engine.config import DEFAULT_CPU_KV_BYTES

            kv = DEFAULT_CPU_KV_BYTES
        total += pool.replicas * pool.tp * sum(w + kv for w in weights)
        per = ", ".join(f"stage {s}: {_gib(w + kv)}" for s, w in enumerate(weights))
        shares.append(
            f"{key} {pool.replicas} x tp {pool.tp} x ({per} a rank)"
            if pool.pp > 1
            else f"{key} {pool.replicas} x tp {pool.tp} x {_gib(weights[0] + kv)}"
        )
    if total <= memory:
        return []
    return [
        f"pools: the workers' weights and KV caches need at least {_gib(total)} ({'; '.join(shares)}"
        f"; each rank loads its stage's layers in the model's dtype, whatever quantization then "
        f"packs them, and holds a KV cache of kv_cache_memory) but this "
        f"machine has {_gib(memory)} free: lower pools.<pool>.kv_cache_memory or .replicas, raise "
        f".pp to split the weights, or join a Ray cluster with more memory (--address)"
    ]


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def amounts(resources: dict) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items()) if v) or "nothing"


def cpus_gpus(resources: dict) -> dict:
    return {k: resources.get(k, 0) for k in ("CPU", "GPU") if resources.get(k)}


def check_resources(config: DeployConfig, total: dict, nodes: list[dict], local: bool) -> None:
    """Refuses at once pools the Ray cluster could not hold even when idle, rather than waiting for
    placement groups that can never be placed: every replica together against the cluster's
    `total`, then each replica against `nodes`: a worker of one stage on one node (STRICT_PACK),
    a pipelined one's ranks on as many nodes as hold them (PACK), or one node each (stage_placement
    spread, STRICT_SPREAD: deploy/placement.py)."""
    need, asks = {}, []
    for key, pool in config.worker_pools():
        bundle = pool.resources.bundle()
        for k, v in bundle.items():
            need[k] = need.get(k, 0) + v * pool.ranks * pool.replicas
        stages = f" x pp {pool.pp}" if pool.pp > 1 else ""
        asks.append(f"{key} {pool.replicas} x tp {pool.tp}{stages} x {amounts(bundle)}")
    short = [k for k, v in sorted(need.items()) if v > total.get(k, 0) + 1e-9]
    if short:
        more = "raise ray.num_cpus" if local and "CPU" in short else "add Ray nodes"
        if local and "GPU" in short:
            more = "join a Ray cluster that has them (ray.address, --address)"
        has = ", ".join(f"{total.get(k, 0):g} {k}" for k in sorted(need))
        raise DeployError(
            f"the pools ask for {amounts(need)} ({'; '.join(asks)}) but the Ray cluster has "
            f"{has}: lower pools.<pool>.replicas, .tp or .resources.num_{short[0].lower()}s, or {more}"
        )
    for key, pool in config.worker_pools():
        bundle = pool.resources.bundle()
        group = {k: v * pool.ranks for k, v in bundle.items()}
        if pool.pp > 1 and nodes:
            _check_stages_fit(key, pool, bundle, nodes)
            continue
        if nodes and not any(all(n.get(k, 0) >= v for k, v in group.items()) for n in nodes):
            biggest = max(nodes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)))
            raise DeployError(
                f"pools.{key}: one replica needs {amounts(group)} on one node (tp "
                f"{pool.tp}{' x pp ' + str(pool.pp) if pool.pp > 1 else ''} x "
                f"{amounts(bundle)}); the largest Ray node has "
                f"{amounts(cpus_gpus(biggest))}: lower pools.{key}.tp or "
                f"pools.{key}.resources"
            )


def bundles_fitting(node: dict, bundle: dict) -> int:
    """How many copies of `bundle` an idle `node` (Ray resources) holds."""
    counts = [int(node.get(k, 0) / v + 1e-9) for k, v in bundle.items() if v > 0]
    return min(counts) if counts else 0


def _check_stages_fit(key: str, pool, bundle: dict, nodes: list[dict]) -> None:
    """One replica of a pipelined pool against the idle `nodes`: under PACK its ranks' bundles
    may fill several nodes; under STRICT_SPREAD each needs a node of its own."""
    shape = f"tp {pool.tp} x pp {pool.pp} ranks of {amounts(bundle)}"
    if pool.stage_placement == "spread":
        room = sum(1 for n in nodes if bundles_fitting(n, bundle) >= 1)
        if room < pool.ranks:
            raise DeployError(
                f"pools.{key}: stage_placement 'spread' needs {pool.ranks} nodes that each hold "
                f"{amounts(bundle)} ({shape}, one per node); the Ray cluster has {room}: add "
                f"nodes, set pools.{key}.stage_placement to 'pack', or lower pools.{key}.pp"
            )
        return
    room = sum(bundles_fitting(n, bundle) for n in nodes)
    if room < pool.ranks:
        raise DeployError(
            f"pools.{key}: one replica needs {shape}; the Ray nodes hold {room} such bundles "
            f"between them: lower pools.{key}.tp, .pp or .resources, or add nodes"
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


def check_http_port_free(config: DeployConfig) -> None:
    """router.http_port as check_port_free checks router.port (uvicorn would fail later, once Ray
    and the router had started)."""
    port = config.router.http_port
    if not port:
        return
    try:
        check_port_free(config.router.host, port)
    except DeployError as e:
        raise DeployError(str(e).replace("router.port", "router.http_port")) from None


def model_path_problem(model: str) -> str | None:
    """Why `model` is not found on this machine (the loader's one-line message), found without
    converting anything (a GGUF is converted into the cache by check_model_fit, later); None
    when it is there."""
    from pdserve.engine.loader.resolve import SMOLLM2_ALIAS, resolve_model, smollm2_gguf_path

    raw = model.strip()
    try:
        if raw.lower() == SMOLLM2_ALIAS:
            smollm2_gguf_path()
        elif not (raw.lower().endswith(".gguf") and pathlib.Path(raw).expanduser().is_file()):
            resolve_model(raw)  # a directory (or a missing .gguf): checked, nothing converted
    except ValueError as e:
        return str(e)
    return None


def local_gpus() -> float:
    """The GPUs a local Ray started by this process would have: Ray's own count (NVML, capped by
    CUDA_VISIBLE_DEVICES), not what the YAML asks for. Imports Ray, so called only when a pool
    asks for GPUs."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource

        manager = get_accelerator_manager_for_resource("GPU")
        count = manager.get_current_node_num_accelerators()
        visible = manager.get_current_process_visible_accelerator_ids()
        return float(count if visible is None else min(count, len(visible)))
    except (ImportError, AttributeError):  # Ray moved its private API: ask torch instead
        import torch

        return float(torch.cuda.device_count())


def check_environment(config: DeployConfig, environ=os.environ) -> None:
    """The settings `up` reads from the environment, checked as it will read them: client API
    keys (PDSERVE_API_KEYS, when no router key setting wins over it) and the cluster secret
    (PDSERVE_CLUSTER_SECRET, likewise); the YAML's own were checked at load."""
    try:
        config.router.client_keys(environ)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    secret, source = config.security.secret(environ)
    if secret is not None:
        try:
            config.security.cluster_security(secret)
        except ValueError as e:
            raise DeployError(f"{source}: {e}") from None


# what no check can know before the workers start (README, "Deploying")
NOT_BEFORE_START = (
    "not knowable before the workers start: the weights loading, the precision each worker "
    "serves (dtype auto probes it), the compiled CPU kernels' build, and a GPU pool's "
    "kv_cache_memory fraction (it depends on the GPU's free memory)"
)


def preflight(config: DeployConfig, address: str | None = None, environ=os.environ) -> list[str]:
    """The checks `pdserve up` and `pdserve up --check` both run, in this order, before Ray starts
    and before any weights load; the first refusal ends them (a ConfigError or DeployError whose
    one line names the key to change):

      1. the model is on this machine (a local Ray; joining a cluster, the workers may load it on
         their nodes: then a note, and only the placement is checked);
      2. the router's gRPC port, then its HTTP port, are free on router.host;
      3. the client keys and cluster secret the environment gives;
      4. the directories `up` writes here (check_writable_dirs);
      5. the pools against the resources a local Ray would have: ray.num_cpus (else the cores)
         and the GPUs Ray finds here (local_gpus), not the YAML's counts, and no custom
         resource; then ray.dashboard against the Ray installed;
      6. the pools against the model (check_model_fit: TP divides the heads, one max_model_len
         sequence fits each rank's KV cache, sized by its pipeline stage's layers; on a local Ray,
         every rank's weights of its stage and KV cache fit the free memory: memory_problems; a
         GGUF is converted into the cache first).

    `address` overrides ray.address. Returns notes on what was not checked: a cluster joined by
    address is checked against its resources only once `up` has joined it."""
    on_this_machine = not (address or config.ray.address)
    notes = []
    missing = model_path_problem(config.model)
    if missing and on_this_machine:
        raise ConfigError("\n".join([missing] + placement_problems(config)))
    if missing:
        notes.append(
            f"the pools were not checked against the model, not on this machine: {missing}"
        )
        if placement_problems(config):  # refused whatever the model
            raise ConfigError("\n".join(placement_problems(config)))
    check_port_free(config.router.host, config.router.port)
    check_http_port_free(config)
    check_environment(config, environ)
    check_writable_dirs(config, on_this_machine, local_ray=on_this_machine)
    if on_this_machine:
        cpus = float(config.ray.num_cpus or os.cpu_count() or 1)
        have = {"CPU": cpus}
        if any(p.resources.num_gpus for _, p in config.worker_pools()):
            have["GPU"] = local_gpus()
        from pdserve.deploy.placement import check_custom_resources  # (it imports this module)

        check_custom_resources(config, have, local=True)  # a local Ray has none
        check_resources(config, have, [have], local=True)
        if config.ray.dashboard:
            from pdserve.deploy.ray_connect import check_dashboard

            check_dashboard()
    else:
        notes.append(
            f"the pools were not checked against the Ray cluster's resources: `up` checks them "
            f"once it has joined {address or config.ray.address}"
        )
    if not missing:
        check_model_fit(config, on_this_machine)
    notes.append(NOT_BEFORE_START)
    return notes
