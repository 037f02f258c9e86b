"""The deployment YAML schema: defaults, the shipped examples, and errors that name file and key."""
from __future__ import annotations

import pathlib
import sys

import pytest

from deploy.cli import main
from deploy.config import ConfigError, DeployConfig, load_config, validate_config

EXAMPLES = sorted((pathlib.Path(__file__).parents[2] / "deploy" / "examples").glob("*.yaml"))


def write(tmp_path, text: str, name: str = "deploy.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error_of(path: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path)
    return str(e.value)


def test_defaults():
    cfg = load_config(None)
    assert cfg == DeployConfig()
    assert cfg.model == "smollm2" and cfg.dtype == "auto"
    for pool in (cfg.pools.prefill, cfg.pools.decode):
        assert (pool.replicas, pool.tp, pool.block_size) == (1, 1, 16)
        assert (pool.resources.num_cpus, pool.resources.num_gpus) == (1, 0)
        assert pool.kv_cache_memory is None and pool.max_model_len is None
    assert (cfg.router.host, cfg.router.port, cfg.router.max_inflight) == ("127.0.0.1", 50051, 64)
    assert cfg.kvtransfer.backend == "grpc"
    assert cfg.ray.address is None and cfg.ray.num_cpus is None


def test_empty_file_gives_the_defaults(tmp_path):
    assert load_config(write(tmp_path, "# nothing set\n")) == DeployConfig()


def test_config_is_frozen():
    cfg = load_config(None)
    with pytest.raises(Exception):
        cfg.pools.decode.replicas = 3


def test_engine_kwargs_pass_pool_settings():
    cfg = validate_config({"dtype": "float32", "pools": {"decode": {
        "kv_cache_memory": 0.5, "block_size": 32, "max_model_len": 256}}})
    kwargs = cfg.engine_kwargs(cfg.pools.decode)
    assert kwargs["dtype"] == "float32" and kwargs["kv_cache_memory"] == 0.5
    assert kwargs["block_size"] == 32 and kwargs["max_model_len"] == 256
    assert "kv_cache_memory" not in cfg.engine_kwargs(cfg.pools.prefill)
    # and the engine accepts exactly these keywords
    from engine.config import EngineConfig
    EngineConfig(model="m", **kwargs)


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= {"local-cpu.yaml", "one-node-8gpu.yaml", "two-nodes.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads(path):
    cfg = load_config(str(path))
    assert cfg.pools.prefill.replicas >= 1 and cfg.pools.decode.replicas >= 1


def test_example_contents():
    by_name = {p.name: load_config(str(p)) for p in EXAMPLES}
    local = by_name["local-cpu.yaml"]
    assert local.model == "smollm2" and local.ray.address is None
    assert local.pools.prefill.resources.num_cpus == 1 and local.pools.decode.resources.num_gpus == 0
    gpu8 = by_name["one-node-8gpu.yaml"]
    gpus = sum(p.replicas * p.tp * p.resources.num_gpus
               for p in (gpu8.pools.prefill, gpu8.pools.decode))
    assert gpus == 8
    assert by_name["two-nodes.yaml"].ray.address == "auto"


@pytest.mark.parametrize("text, key, words", [
    ("pools:\n  decode:\n    replicas: 0\n", "pools.decode.replicas", "greater than or equal to 1"),
    ("pools:\n  prefill:\n    tp: 0\n", "pools.prefill.tp", "greater than or equal to 1"),
    ("pools:\n  decode:\n    replicaz: 2\n", "pools.decode.replicaz", "unknown key"),
    ("modle: smollm2\n", "modle", "unknown key"),
    ("kvtransfer:\n  backend: nccl\n", "kvtransfer.backend", "'grpc', 'shm' or 'torch'"),
    ("pools:\n  prefill:\n    replicas: two\n", "pools.prefill.replicas", "valid integer"),
    ("router:\n  port: '50051'\n", "router.port", "valid integer"),
    ("router:\n  decode_queue_timeout_s: 0\n", "router.decode_queue_timeout_s", "greater than 0"),
    ("pools:\n  decode:\n    kv_cache_memory: 1.5\n", "pools.decode.kv_cache_memory", "fraction"),
    ("pools:\n  decode:\n    block_size: 12\n", "pools.decode.block_size", "power of two"),
    ("pools:\n  decode:\n    resources: {num_cpus: 0}\n", "pools.decode.resources", "both be 0"),
    ("pools:\n  decode: 3\n", "pools.decode", "valid dictionary"),
])
def test_errors_name_file_and_key(tmp_path, text, key, words):
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg.startswith(f"{path}: {key}: "), msg
    assert words in msg


def test_replicas_zero_message_exactly(tmp_path):
    path = write(tmp_path, "pools:\n  decode:\n    replicas: 0\n")
    assert error_of(path) == (f"{path}: pools.decode.replicas: "
                              f"Input should be greater than or equal to 1 (got 0)")


def test_unknown_key_lists_the_allowed_ones(tmp_path):
    msg = error_of(write(tmp_path, "router:\n  max_in_flight: 8\n"))
    assert "router.max_in_flight: unknown key" in msg
    assert "allowed here: decode_queue_timeout_s, host, max_inflight, port" in msg


def test_every_bad_key_is_reported(tmp_path):
    msg = error_of(write(tmp_path, "pools:\n  decode: {tp: 0}\n  prefill: {replicas: -1}\n"))
    assert "pools.decode.tp" in msg and "pools.prefill.replicas" in msg


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "model: smollm2\npools:\n  decode:\n    replicas: [1, 2\n  prefill: {}\n")
    msg = error_of(path)
    assert msg.startswith(f"{path}: line "), msg
    assert "YAML syntax error" in msg
    line = int(msg.split("line ")[1].split(",")[0])
    assert 4 <= line <= 5     # the unclosed list opens on line 4; the parser notices on 5


def test_top_level_must_be_a_mapping(tmp_path):
    msg = error_of(write(tmp_path, "- a\n- b\n"))
    assert "top level must be a mapping" in msg


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    assert error_of(path).startswith(f"{path}: cannot read")


def test_cli_up_with_bad_config_exits_2_without_ray(tmp_path, capsys):
    ray_loaded = "ray" in sys.modules
    path = write(tmp_path, "pools:\n  decode:\n    replicas: 0\n", name="bad.yaml")
    assert main(["up", path]) == 2
    err = capsys.readouterr().err
    assert f"{path}: pools.decode.replicas: Input should be greater than or equal to 1" in err
    assert "Traceback" not in err
    if not ray_loaded:   # the config is checked before Ray is even imported
        assert "ray" not in sys.modules


def test_cli_up_rejects_a_tp_the_heads_cannot_split_before_ray(tmp_path, capsys, monkeypatch, tiny_models):
    import ray
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called"))
    model_dir = tiny_models("llama-gqa")[0]   # 4 heads, 2 key/value heads
    assert main(["up", write(tmp_path, f"model: {model_dir}\npools:\n  decode: {{tp: 4}}\n")]) == 2
    err = capsys.readouterr().err
    assert "pools.decode.tp: 4 does not divide" in err and "use one of [1, 2]" in err


def test_core_plan_gives_each_local_replica_its_own_cores(monkeypatch):
    from deploy import launcher
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    pools = lambda prefill, decode: validate_config({"pools": {  # noqa: E731
        "prefill": prefill, "decode": decode}}).worker_pools()
    one = {"resources": {"num_cpus": 1}}
    # decode first (start order), then prefill; num_threads x tp cores each
    assert launcher.core_plan(pools({**one, "num_threads": 2}, {**one, "replicas": 2}), local=True) == {
        ("decode", 0): [0], ("decode", 1): [1], ("prefill", 0): [2, 3]}
    # more compute threads than cores, a Ray cluster given by address, GPU pools: no pinning
    assert launcher.core_plan(pools({**one, "tp": 3}, {**one, "replicas": 2}), local=True) == {}
    assert launcher.core_plan(pools(one, one), local=False) == {}
    gpu = {"resources": {"num_cpus": 1, "num_gpus": 1}}
    assert launcher.core_plan(pools(gpu, gpu), local=True) == {}
