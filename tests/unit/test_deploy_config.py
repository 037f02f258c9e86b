"""The deployment YAML schema: defaults, the shipped examples, errors that name file and key, and
the offline checks of the pools against the model (the security settings:
test_deploy_security.py). The checks that `pdserve up` runs on the real SmolLM2 and a tiny model
through the CLI: tests/integration/test_deploy_config_fit.py."""

from __future__ import annotations

import sys

import pydantic
import pytest

from helpers.deploy_config import EXAMPLES, error_of, on_gpus, write
from pdserve.cli import main
from pdserve.deploy.config.load import ConfigError, load_config, validate_config
from pdserve.deploy.config.schema import DeployConfig


def test_defaults():
    cfg = load_config(None)
    assert cfg == DeployConfig()
    assert cfg.model == "smollm2" and cfg.dtype == "auto"
    for pool in (cfg.pools.prefill, cfg.pools.decode):
        assert (pool.replicas, pool.tp, pool.block_size) == (1, 1, 16)
        assert (pool.resources.num_cpus, pool.resources.num_gpus) == (1, 0)
        assert pool.kv_cache_memory is None and pool.max_model_len is None
    assert (cfg.router.host, cfg.router.port, cfg.router.max_inflight) == ("127.0.0.1", 50051, 64)
    assert cfg.kvtransfer.backend == "auto"
    assert cfg.ray.address is None and cfg.ray.num_cpus is None


def test_empty_file_gives_the_defaults(tmp_path):
    assert load_config(write(tmp_path, "# nothing set\n")) == DeployConfig()


def test_config_is_frozen():
    cfg = load_config(None)
    with pytest.raises(pydantic.ValidationError):
        cfg.pools.decode.replicas = 3


def test_engine_kwargs_pass_pool_settings():
    cfg = validate_config(
        {
            "dtype": "float32",
            "pools": {"decode": {"kv_cache_memory": 0.5, "block_size": 32, "max_model_len": 256}},
        }
    )
    kwargs = cfg.engine_kwargs(cfg.pools.decode)
    assert kwargs["dtype"] == "float32" and kwargs["kv_cache_memory"] == 0.5
    assert kwargs["prefill_step_target_s"] == 0.5  # the documented default
    assert kwargs["block_size"] == 32 and kwargs["max_model_len"] == 256
    assert "kv_cache_memory" not in cfg.engine_kwargs(cfg.pools.prefill)
    # and the engine accepts exactly these keywords
    from pdserve.engine.config import EngineConfig

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
    assert (
        local.pools.prefill.resources.num_cpus == 1 and local.pools.decode.resources.num_gpus == 0
    )
    gpu8 = by_name["one-node-8gpu.yaml"]
    gpus = sum(
        p.replicas * p.tp * p.resources.num_gpus for p in (gpu8.pools.prefill, gpu8.pools.decode)
    )
    assert gpus == 8
    assert by_name["two-nodes.yaml"].ray.address == "auto"


@pytest.mark.parametrize(
    "text, key, words",
    [
        (
            "pools:\n  decode:\n    replicas: 0\n",
            "pools.decode.replicas",
            "greater than or equal to 1",
        ),
        ("pools:\n  prefill:\n    tp: 0\n", "pools.prefill.tp", "greater than or equal to 1"),
        ("pools:\n  decode:\n    replicaz: 2\n", "pools.decode.replicaz", "unknown key"),
        ("modle: smollm2\n", "modle", "unknown key"),
        (
            "kvtransfer:\n  backend: nccl\n",
            "kvtransfer.backend",
            "'shm', 'torch', 'nixl' or 'cuda_ipc'",
        ),
        ("pools:\n  prefill:\n    replicas: two\n", "pools.prefill.replicas", "valid integer"),
        ("router:\n  port: '50051'\n", "router.port", "valid integer"),
        (
            "router:\n  decode_queue_timeout_s: 0\n",
            "router.decode_queue_timeout_s",
            "greater than 0",
        ),
        (
            "pools:\n  decode:\n    kv_cache_memory: 1.5\n",
            "pools.decode.kv_cache_memory",
            "fraction",
        ),
        ("pools:\n  decode:\n    block_size: 12\n", "pools.decode.block_size", "power of two"),
        (
            "pools:\n  decode:\n    resources: {num_cpus: 0}\n",
            "pools.decode.resources",
            "both be 0",
        ),
        ("pools:\n  decode: 3\n", "pools.decode", "valid dictionary"),
        (
            "pools:\n  prefill:\n    prefill_step_target_s: -1\n",
            "pools.prefill.prefill_step_target_s",
            "greater than or equal to 0",
        ),
        ("router:\n  stream_interval: 0\n", "router.stream_interval", "greater than or equal to 1"),
        # retired: the message says what replaced it
        ("router:\n  prefill_timeout_s: 60\n", "router", "client's deadline"),
    ],
)
def test_errors_name_file_and_key(tmp_path, text, key, words):
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg.startswith(f"{path}: {key}: "), msg
    assert words in msg


def test_replicas_zero_message_exactly(tmp_path):
    path = write(tmp_path, "pools:\n  decode:\n    replicas: 0\n")
    assert error_of(path) == (
        f"{path}: pools.decode.replicas: Input should be greater than or equal to 1 (got 0)"
    )


def test_unknown_key_lists_the_allowed_ones(tmp_path):
    msg = error_of(write(tmp_path, "router:\n  max_in_flight: 8\n"))
    assert "router.max_in_flight: unknown key" in msg
    assert (
        "allowed here: allowed_media_domains, api_keys, api_keys_file, batch_max_inflight, "
        "cors_allowed_origins, decode_queue_timeout_s, embedding_normalize, embedding_pooling, "
        "files_dir, files_store_mb, flip_drain_s, host, http_body_timeout_s, "
        "http_header_timeout_s, "
        "http_max_connections, http_port, limit_mm_per_prompt, local_prefill, max_inflight, "
        "max_queue_wait_s, "
        "max_queued, metrics_keys_file, mm_processor_kwargs, pause_endpoints, peer_fetch, port, "
        "reconcile_bound_s, "
        "responses_store_mb, scheduling_policy, sleep_mode, stream_interval, tls, weight_updates, "
        "worker_down_s, worker_silence_s, worker_stall_factor, worker_stall_s" in msg
    )


def test_every_bad_key_is_reported(tmp_path):
    msg = error_of(write(tmp_path, "pools:\n  decode: {tp: 0}\n  prefill: {replicas: -1}\n"))
    assert "pools.decode.tp" in msg and "pools.prefill.replicas" in msg


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(
        tmp_path, "model: smollm2\npools:\n  decode:\n    replicas: [1, 2\n  prefill: {}\n"
    )
    msg = error_of(path)
    assert msg.startswith(f"{path}: line "), msg
    assert "YAML syntax error" in msg
    line = int(msg.split("line ")[1].split(",")[0])
    assert 4 <= line <= 5  # the unclosed list opens on line 4; the parser notices on 5


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
    if not ray_loaded:  # the config is checked before Ray is even imported
        assert "ray" not in sys.modules


def test_core_plan_gives_each_local_replica_its_own_cores(monkeypatch):
    from pdserve.deploy import launcher

    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})

    def pools(prefill, decode):
        return validate_config({"pools": {"prefill": prefill, "decode": decode}}).worker_pools()

    one = {"resources": {"num_cpus": 1}}
    # decode first (start order), then prefill; num_threads x tp cores each
    assert launcher.core_plan(
        pools({**one, "num_threads": 2}, {**one, "replicas": 2}), local=True
    ) == {("decode", 0): [0], ("decode", 1): [1], ("prefill", 0): [2, 3]}
    # more compute threads than cores, a Ray cluster given by address, GPU pools: no pinning
    assert launcher.core_plan(pools({**one, "tp": 3}, {**one, "replicas": 2}), local=True) == {}
    assert launcher.core_plan(pools(one, one), local=False) == {}
    gpu = {"resources": {"num_cpus": 1, "num_gpus": 1}}
    assert launcher.core_plan(pools(gpu, gpu), local=True) == {}


# ---- the shipped examples fit the model and the machine they are for ------------------------------
# config.json of the models the GPU examples name, which are not on a CPU machine (from
# HuggingFaceTB/SmolLM2-1.7B-Instruct)
ABSENT_MODELS = {
    "/models/SmolLM2-1.7B-Instruct": {
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "num_hidden_layers": 24,
        "hidden_size": 2048,
        "max_position_embeddings": 8192,
    }
}


@pytest.mark.parametrize("path", [p for p in EXAMPLES if on_gpus(p)], ids=lambda p: p.name)
def test_example_fits_its_model_and_machine(path):
    """The GPU examples, against the config.json of the models they name: heads, max_model_len, and
    fixed KV bytes (a fraction of GPU memory needs the GPU). The CPU examples, against the real
    SmolLM2 and the machine they are for: tests/integration/test_deploy_config_fit.py."""
    from pdserve.deploy.config.checks import fit_problems

    cfg = load_config(str(path))
    assert fit_problems(cfg, ABSENT_MODELS[cfg.model], cpu_memory_bytes=None) == []


def test_fit_check_matches_what_the_engine_refuses(tiny_models):
    """The launcher's KV arithmetic and the engine's agree at the boundary: one byte less than
    the bytes the message asks for, the engine refuses to start; exactly those, it starts."""
    import re

    from pdserve.deploy.config.checks import fit_problems
    from pdserve.engine import LLM
    from pdserve.engine.loader import load_hf_config

    model_dir = tiny_models("llama-gqa")[0]
    cfg = validate_config(
        {
            "model": model_dir,
            "dtype": "float32",
            "pools": {"prefill": {"kv_cache_memory": 1000, "max_model_len": 64, "block_size": 16}},
        }
    )
    problems = fit_problems(cfg, load_hf_config(model_dir))
    assert len(problems) == 1 and problems[0].startswith(
        "pools.prefill: kv_cache_memory of 1000 bytes"
    )
    need = int(
        re.search(r"set pools.prefill.kv_cache_memory to at least (\d+)", problems[0]).group(1)
    )
    with pytest.raises(ValueError, match="raise kv_cache_memory or lower max_model_len"):
        LLM(model_dir, dtype="float32", kv_cache_memory=need - 1, max_model_len=64)
    LLM(model_dir, dtype="float32", kv_cache_memory=need, max_model_len=64).shutdown()
    ok = validate_config(
        {"model": model_dir, "pools": {"prefill": {"kv_cache_memory": need, "max_model_len": 64}}}
    )
    assert fit_problems(ok, load_hf_config(model_dir)) == []


def test_fit_check_suggests_what_to_change():
    from pdserve.deploy.config.checks import fit_problems

    hf = {
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "head_dim": 64,
        "max_position_embeddings": 8192,
    }  # SmolLM2-135M
    cfg = validate_config(
        {
            "pools": {
                "prefill": {"kv_cache_memory": 256 << 20},
                "decode": {"max_model_len": 9000, "tp": 2},
            }
        }
    )
    problems = fit_problems(cfg, hf)
    assert problems == [
        "pools.decode.tp: 2 does not divide the model's 9 attention heads and 3 key/value heads; "
        "use one of [1, 3]",
        "pools.prefill: kv_cache_memory of 268435456 bytes (256 MiB) holds 364 KV blocks of 16 "
        "tokens, but one sequence of max_model_len 8192 needs 512: set pools.prefill.kv_cache_memory "
        "to at least 377487360 (360 MiB) or pools.prefill.max_model_len to at most 5824",
    ]
    too_long = validate_config({"pools": {"decode": {"max_model_len": 9000}}})
    assert fit_problems(too_long, hf) == [
        "pools.decode.max_model_len: 9000 is more than the model's max_position_embeddings "
        "(8192); lower it"
    ]
    # a GPU pool's fraction of GPU memory cannot be checked here; a CPU pool's is, against memory
    frac = validate_config(
        {
            "pools": {
                "prefill": {"kv_cache_memory": 0.5},
                "decode": {"kv_cache_memory": 0.001, "resources": {"num_gpus": 1}},
            }
        }
    )
    assert fit_problems(frac, hf, cpu_memory_bytes=None) == []
    assert fit_problems(frac, hf, cpu_memory_bytes=600 << 20)[0].startswith(
        "pools.prefill: kv_cache_memory of 314572800 bytes (300 MiB)"
    )


def test_fit_check_counts_an_mla_latent():
    """DeepSeek's KV is one latent a token a layer (576 values for V2-Lite), on every TP rank:
    not num_key_value_heads heads of 128 keys and values, which would refuse pools that fit."""
    from pdserve.deploy.config.checks import fit_problems

    hf = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_hidden_layers": 27,
        "hidden_size": 2048,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "max_position_embeddings": 163840,
    }  # DeepSeek-V2-Lite
    per_token = 27 * 576 * 4  # float32
    fits = {"kv_cache_memory": 4096 * per_token, "max_model_len": 4096, "tp": 2}
    cfg = validate_config({"pools": {"prefill": fits, "decode": fits}})
    assert fit_problems(cfg, hf) == []
    short = dict(fits, kv_cache_memory=4095 * per_token)
    problems = fit_problems(validate_config({"pools": {"prefill": fits, "decode": short}}), hf)
    assert problems == [
        f"pools.decode: kv_cache_memory of {4095 * per_token} bytes (243 MiB) holds 255 KV blocks "
        f"of 16 tokens, but one sequence of max_model_len 4096 needs 256: set "
        f"pools.decode.kv_cache_memory to at least {4096 * per_token} (243 MiB) or "
        f"pools.decode.max_model_len to at most 4080"
    ]


@pytest.mark.parametrize("old", ["stats_timeout_s", "down_after"])
def test_retired_health_keys_name_their_successors(tmp_path, old):
    msg = error_of(write(tmp_path, f"router:\n  {old}: 2\n"))
    assert f"{old} is retired" in msg and "worker_silence_s" in msg


def test_worker_down_s_must_not_exceed_worker_silence_s(tmp_path):
    msg = error_of(write(tmp_path, "router:\n  worker_down_s: 5.0\n  worker_silence_s: 4.0\n"))
    assert "worker_down_s (5) must not exceed worker_silence_s (4)" in msg


def test_a_prefill_pool_in_stages(monkeypatch):
    """pools.prefill.pp: the engine's pipeline_parallel_size, one resources bundle and one core
    per rank (tp x pp), prefill-only workers (they do not flip to decode); decode and colocated
    pools stay in one stage, the refusal naming the key."""
    from pdserve.deploy import launcher
    from pdserve.deploy.placement import pg_options
    from pdserve.deploy.start_table import row

    cfg = validate_config({"pools": {"prefill": {"tp": 2, "pp": 2, "resources": {"num_cpus": 1}}}})
    pool = cfg.pools.prefill
    assert pool.ranks == 4 and cfg.engine_kwargs(pool)["pipeline_parallel_size"] == 2
    assert cfg.engine_kwargs(cfg.pools.decode)["pipeline_parallel_size"] == 1
    assert len(pg_options(pool)["bundles"]) == 4
    assert not launcher._flippable(cfg, pool) and launcher._flippable(cfg, cfg.pools.decode)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: set(range(5)))
    plan = launcher.core_plan(cfg.worker_pools(), local=True)
    assert plan == {("decode", 0): [0], ("prefill", 0): [1, 2, 3, 4]}
    info = {"dtype": "float32", "tp": 2, "pp": 2}
    assert row(info)[5] == "float32, tp 2, pp 2"
    for key in ("decode", "colocated"):
        with pytest.raises(ConfigError, match=f"pools: {key}.pp must be 1: {key} workers decode"):
            validate_config({"pools": {key: {"pp": 2}}})


def test_a_chat_template_is_read_from_a_file_or_given_as_itself(tmp_path):
    """vLLM's --chat-template: a file (relative to the YAML's folder) or the template itself,
    parsed when the config loads."""
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert validate_config({"chat_template": inline}).chat_template == inline
    (tmp_path / "t.jinja").write_text(inline + "\n")
    loaded = validate_config({"chat_template": "t.jinja"}, base_dir=tmp_path)
    assert loaded.chat_template == inline + "\n"
    with pytest.raises(
        ConfigError, match="chat_template: .*neither a Jinja template nor a readable"
    ):
        validate_config({"chat_template": "missing.jinja"}, base_dir=tmp_path)
    with pytest.raises(ConfigError, match="chat_template: .*not a Jinja template"):
        validate_config({"chat_template": "{% for m in messages %}{{ m }}"})


def test_hf_overrides_reach_every_worker_and_the_router():
    """vLLM's --hf-overrides keys pdserve serves: the label tokens go to every pool's engine and
    to the router (its labels), the Matryoshka keys to the router; another key, an empty list or
    an empty token is refused naming the field."""
    from pdserve.deploy.launcher import _matryoshka
    from pdserve.router.server import class_labels

    cfg = validate_config({"hf_overrides": {"classifier_from_token": ["no", "yes"]}})
    for _, pool in cfg.worker_pools():
        assert cfg.engine_kwargs(pool)["classifier_from_token"] == ("no", "yes")
    assert "classifier_from_token" not in validate_config({}).engine_kwargs(cfg.pools.decode)
    assert _matryoshka(cfg.hf_overrides) is None
    dims = validate_config({"hf_overrides": {"matryoshka_dimensions": [64, 128]}})
    assert _matryoshka(dims.hf_overrides) == (64, 128)
    assert _matryoshka(validate_config({"hf_overrides": {"is_matryoshka": True}}).hf_overrides)
    assert class_labels({"architectures": ["Qwen3ForCausalLM"]}, ("no", "yes")) == (
        ("no", "yes"),
        True,
    )
    hf = {"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "a", "1": "b"}}
    assert class_labels(hf, ()) == (("a", "b"), False)
    for bad in ({"classifier_from_token": []}, {"classifier_from_token": [""]}, {"rope_theta": 1}):
        with pytest.raises(ConfigError, match="hf_overrides"):
            validate_config({"hf_overrides": bad})
