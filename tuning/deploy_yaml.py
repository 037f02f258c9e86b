"""The deploy YAML `pdserve tune` writes for its best placement (deploy.config's schema, with the
router's and Ray's settings) and the launcher's offline checks on it (validate_config, and
fit_problems with the model's shape from the profile, and the engine's refusal of a GPU prefill
pool in stages): the tuner leaves out the placements `pdserve up` would refuse, and never writes
one. A prefill pool in stages is written with its `pp`."""

from __future__ import annotations

import pathlib

import yaml

from pdserve.tuning.perf_model import Profile
from pdserve.tuning.slo import TuneError
from pdserve.tuning.tuner import Candidate


def deploy_yaml(
    cand: Candidate,
    profile: Profile,
    model: str,
    backend: str,
    *,
    router_host: str | None = None,
    router_port: int = 50051,
    ray_address: str | None = None,
) -> dict:
    """The placement as deploy YAML data (deploy.config's schema), with the router's and Ray's
    settings: a local Ray (ray_address None) gets num_cpus = the CPUs the pools reserve, and the
    router listens on loopback; joining a cluster, on every interface."""
    hw = profile.raw.get("hardware", {})
    kv_memory = hw.get("kv_cache_memory")
    gpu = profile.device == "gpu"

    def pool(spec) -> dict:
        out = {
            "replicas": spec.replicas,
            "tp": spec.tp,
            **({"pp": spec.pp} if spec.pp > 1 else {}),
            "resources": {"num_cpus": 1, "num_gpus": 1} if gpu else {"num_cpus": 1},
            "max_num_batched_tokens": spec.max_num_batched_tokens,
            "max_num_seqs": spec.max_num_seqs,
        }
        if (
            isinstance(kv_memory, (int, float))
            and not isinstance(kv_memory, bool)
            and kv_memory > 0
        ):
            out["kv_cache_memory"] = kv_memory
        if not gpu and hw.get("threads_per_rank"):
            out["num_threads"] = int(hw["threads_per_rank"])
        return out

    pl = cand.placement
    pools = (
        {"colocated": pool(pl.decode)}
        if pl.colocated
        else {"prefill": pool(pl.prefill), "decode": pool(pl.decode)}
    )
    data = {
        "model": model,
        "dtype": profile.dtype if profile.dtype != "auto" else "auto",
        "pools": pools,
    }
    if not pl.colocated:
        data["kvtransfer"] = {"backend": backend}
    host = router_host or ("0.0.0.0" if ray_address else "127.0.0.1")
    data["router"] = {"host": host, "port": router_port}
    if ray_address:
        data["ray"] = {"address": ray_address}
    else:
        specs = [pl.decode] if pl.colocated else [pl.prefill, pl.decode]
        data["ray"] = {"address": None, "num_cpus": sum(s.replicas * s.devices for s in specs)}
    return data


def hf_config(profile: Profile) -> dict:
    """The model's shape as config.json would give it, from the profile (for fit_problems)."""
    m = profile.raw["model"]
    return {
        "num_attention_heads": m["num_heads"],
        "num_key_value_heads": m["num_kv_heads"],
        "head_dim": m["head_dim"],
        "hidden_size": m["hidden_size"],
        "num_hidden_layers": m["num_layers"],
    }


def launcher_problems(data: dict, profile: Profile) -> list[str]:
    """Why `pdserve up` would refuse this YAML data before starting Ray, [] when it would not:
    the schema (validate_config) and the pools against the model (fit_problems, with the model's
    shape from the profile: the launcher's own check once the model is on the machine)."""
    from pdserve.deploy.config.checks import fit_problems
    from pdserve.deploy.config.load import ConfigError, validate_config

    try:
        cfg = validate_config(data)
    except ConfigError as e:
        return str(e).splitlines()
    return fit_problems(cfg, hf_config(profile)) + _stage_problems(cfg)


def _stage_problems(cfg) -> list[str]:
    """A prefill pool in stages on GPUs: the engine refuses it at start (its stages' KV pools
    are files under kv_cache_shared_dir, which needs KV in CPU memory: engine/engine_core.py),
    though deploy/config/checks.py does not say so before Ray starts."""
    pool = cfg.pools.prefill if cfg.pools.colocated is None else None
    if pool is not None and pool.pp > 1 and pool.resources.num_gpus > 0:
        return [
            f"pools.prefill.pp: {pool.pp} on GPUs is refused today (a prefill worker in stages "
            f"hands its later stages' KV off through CPU shared memory, which GPU KV pools "
            f"cannot use): set pools.prefill.pp to 1"
        ]
    return []


def write_yaml(path: str, data: dict, header: list[str], profile: Profile) -> None:
    problems = launcher_problems(data, profile)
    if problems:
        raise TuneError(
            "the best placement would be refused by `pdserve up`, not written:\n"
            + "\n".join(problems)
        )
    text = "".join(f"# {line}\n" for line in header) + yaml.safe_dump(data, sort_keys=False)
    pathlib.Path(path).write_text(text)
