"""The deployment YAML's checks of the pools against a model that `pdserve up` runs before Ray
starts, through the CLI and on the real SmolLM2: the shipped CPU examples fit it and the 2-core
machine they are for, `up --check` validates local-cpu.yaml, and `up` refuses a tp that the
model's heads cannot split. The schema, and the checks against a model's config.json alone:
tests/unit/test_deploy_config.py."""

from __future__ import annotations

import pytest

from helpers.deploy_config import EXAMPLES, on_gpus, write
from pdserve.cli import main
from pdserve.deploy.config.load import load_config


# ---- the shipped examples fit the model and the machine they are for ------------------------------
@pytest.mark.parametrize("path", [p for p in EXAMPLES if not on_gpus(p)], ids=lambda p: p.name)
def test_example_fits_its_model_and_machine(path):
    """The CPU examples, against the real SmolLM2: every KV check, fractions against a 24 GiB
    machine, and the 2-core machine they are for holds every pool. The GPU examples:
    tests/unit/test_deploy_config.py."""
    from pdserve.deploy.config.checks import fit_problems
    from pdserve.deploy.launcher import check_resources
    from pdserve.engine.loader import load_hf_config, resolve_model

    cfg = load_config(str(path))
    hf = load_hf_config(resolve_model(cfg.model))
    assert fit_problems(cfg, hf, cpu_memory_bytes=24 << 30) == []
    assert cfg.ray.num_cpus is None or cfg.ray.num_cpus <= 2
    check_resources(cfg, {"CPU": 2.0}, [{"CPU": 2.0}], local=True)
    kv = sum(p.replicas * p.tp * (p.kv_cache_memory or 1 << 30) for _, p in cfg.worker_pools())
    assert kv < 8 << 30, "KV caches beyond a third of a 24 GiB machine"


# ---- pdserve up ---------------------------------------------------------------------------------
def test_cli_up_rejects_a_tp_the_heads_cannot_split_before_ray(
    tmp_path, capsys, monkeypatch, tiny_models
):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called"))
    model_dir = tiny_models("llama-gqa")[0]  # 4 heads, 2 key/value heads
    yaml = (  # CPUs fit; port 0, since the ports are checked before the model
        f"model: {model_dir}\nray: {{num_cpus: 8}}\nrouter: {{port: 0}}\n"
        "pools:\n  decode: {tp: 4}\n"
    )
    assert main(["up", write(tmp_path, yaml)]) == 2
    err = capsys.readouterr().err
    assert "pools.decode.tp: 4 does not divide" in err and "use one of [1, 2]" in err


# ---- pdserve up --check -------------------------------------------------------------------------
@pytest.mark.exclusive("default-ports")  # local-cpu.yaml's --check checks 50051 and 8000 are free
def test_up_check_validates_without_starting_ray(tmp_path, capsys, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called"))
    local = [p for p in EXAMPLES if p.name == "local-cpu.yaml"][0]
    assert main(["up", str(local), "--check"]) == 0
    assert "ok (smollm2" in capsys.readouterr().out
    gpu_tp2 = write(
        tmp_path,
        "model: /nowhere/model\npools:\n"
        "  prefill: {resources: {num_gpus: 1}}\n"
        "  decode: {tp: 2, resources: {num_gpus: 1}}\n"
        "ray: {address: auto}\n",
    )
    assert main(["up", gpu_tp2, "--check"]) == 2
    assert "pools.decode.tp: 2 on GPUs is refused today" in capsys.readouterr().err
