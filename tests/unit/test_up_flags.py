"""`pdserve up`'s flags over the deployment YAML (pdserve/up_flags.py): a flag over the YAML's key,
the YAML's key over the default, the default when neither; one pool's flag over the flag for every
pool; a bad value refused in one line that names the flag, by the schema's own checks and by the
checks before the start. No socket: nothing here gets as far as the port probes."""

from __future__ import annotations

import argparse

import pytest
import yaml

from helpers.up import flags_config as _up
from pdserve.cli import main
from pdserve.deploy.config.checks import fit_problems
from pdserve.deploy.config.load import ConfigError, validate_config
from pdserve.deploy.config.schema import DeployConfig
from pdserve.up_flags import add_up_flags, up_config

KEY = "sk-flag-key-00000001"


YAML = {
    "model": "yaml-model-dir",
    "served_model_name": "yaml-name",
    "pools": {
        "prefill": {"replicas": 2, "tp": 2, "max_model_len": 512},
        "decode": {"replicas": 3, "tp": 1, "max_model_len": 512},
    },
    "router": {"host": "0.0.0.0", "port": 50060, "http_port": 8080, "api_keys": [KEY * 2]},
}


def test_a_flag_wins_over_the_yaml(tmp_path):
    c = _up(
        tmp_path, YAML,
        "--model", "flag-model", "--served-model-name", "flag-name",
        "--prefill-replicas", "1", "--decode-replicas", "4", "--prefill-tp", "3", "--decode-tp", "2",
        "--max-model-len", "256", "--host", "127.0.0.2", "--port", "50070",
        "--http-port", "off", "--api-key", KEY,
    )  # fmt: skip
    assert (c.model, c.served_model_name) == ("flag-model", "flag-name")
    assert (c.pools.prefill.replicas, c.pools.prefill.tp) == (1, 3)
    assert (c.pools.decode.replicas, c.pools.decode.tp) == (4, 2)
    assert c.pools.prefill.max_model_len == c.pools.decode.max_model_len == 256
    assert (c.router.host, c.router.port, c.router.http_port) == ("127.0.0.2", 50070, None)
    assert c.router.client_keys({}) == ((KEY,), "router.api_keys")


def test_vllm_s_qwen3_reranker_overrides_set_the_label_tokens(tmp_path):
    """vLLM's --hf-overrides recipe for Qwen3-Reranker runs as it is; other keys are refused
    naming the flag and the key."""
    overrides = (
        '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", '
        '"yes"], "is_original_qwen3_reranker": true}'
    )
    c = _up(tmp_path, None, "--hf-overrides", overrides)
    assert c.hf_overrides.classifier_from_token == ["no", "yes"]
    c = _up(tmp_path, None, "--hf-overrides", '{"matryoshka_dimensions": [32, 64]}')
    assert c.hf_overrides.matryoshka_dimensions == [32, 64]
    for bad, why in (
        ('{"rope_theta": 1}', "rope_theta"),
        ('["no"]', "a JSON object"),
        ('{"classifier_from_token": []}', "at least 1 item"),
    ):
        with pytest.raises(ConfigError, match=f"--hf-overrides.*{why}"):
            _up(tmp_path, None, "--hf-overrides", bad)


def test_vllm_s_flag_names_set_the_same_keys(tmp_path):
    c = _up(
        tmp_path, None,
        "--tensor-parallel-size", "3", "--max-num-seqs", "7", "--max-num-batched-tokens", "96",
    )  # fmt: skip
    for pool in (c.pools.prefill, c.pools.decode):
        assert (pool.tp, pool.max_num_seqs, pool.max_num_batched_tokens) == (3, 7, 96)


def test_vllm_s_parser_flags_are_taken_and_said_to_be_unneeded(capsys, tiny_models):
    """A vLLM command line's --enable-auto-tool-choice, --tool-call-parser and
    --reasoning-parser run (the router reads those formats from the model) with a note."""
    src, _ = tiny_models("llama-gqa")
    args = [
        "up", "--check", "--model", str(src), "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--port", "0",
        "--http-port", "off",
    ]  # fmt: skip
    assert main(args) == 0
    err = capsys.readouterr().err
    assert (
        "--enable-auto-tool-choice, --tool-call-parser hermes, --reasoning-parser qwen3: not "
        in err
    )


def test_the_yaml_wins_over_the_default(tmp_path):
    c = _up(tmp_path, YAML)
    assert c == validate_config(YAML)  # the same keys, read the same way
    assert c != DeployConfig()
    # a flag for another key leaves the YAML's keys as they are
    assert _up(tmp_path, YAML, "--port", "50071").pools == c.pools


def test_the_default_when_neither(tmp_path):
    assert _up(tmp_path, None) == DeployConfig()
    assert _up(tmp_path, {}) == DeployConfig()
    # `pdserve up --model X`: no YAML at all, the defaults for everything else
    c = _up(tmp_path, None, "--model", "some/dir")
    assert c == DeployConfig(model="some/dir")


def test_one_pools_flag_wins_over_the_flag_for_every_pool(tmp_path):
    c = _up(tmp_path, None, "--tp", "2", "--decode-tp", "1")
    assert (c.pools.prefill.tp, c.pools.decode.tp) == (2, 1)
    c = _up(tmp_path, YAML, "--tp", "4")
    assert (c.pools.prefill.tp, c.pools.decode.tp) == (4, 4)
    # a colocated YAML: --tp and --max-model-len set its one pool, and no other appears
    colocated = {"pools": {"colocated": {"replicas": 2}}}
    c = _up(tmp_path, colocated, "--tp", "2", "--max-model-len", "128")
    assert (c.pools.colocated.replicas, c.pools.colocated.tp) == (2, 2)
    assert c.pools.colocated.max_model_len == 128
    assert _up(tmp_path, None, "--colocated-replicas", "2").pools.colocated.replicas == 2


def test_api_key_flag_replaces_the_yamls_keys_file(tmp_path):
    (tmp_path / "keys.txt").write_text(KEY * 2 + "\n")
    c = _up(tmp_path, {"router": {"api_keys_file": "keys.txt"}}, "--api-key", KEY)
    assert c.router.api_keys_file is None
    assert c.router.client_keys({"PDSERVE_API_KEYS": "sk-env-key-000001"})[0] == (KEY,)
    c = _up(tmp_path, None, "--api-key", KEY, "--api-key", KEY + "x")
    assert c.router.client_keys({})[0] == (KEY, KEY + "x")


BAD = [
    (["--decode-tp", "0"], "--decode-tp: Input should be greater than or equal to 1 (got 0)"),
    (["--prefill-tp", "two"], "--prefill-tp: must be an integer, got 'two'"),
    (["--tp", "1.5"], "--tp: must be an integer, got '1.5'"),
    (["--prefill-replicas", "0"], "--prefill-replicas: Input should be greater than or equal"),
    (["--decode-replicas", "-1"], "--decode-replicas: Input should be greater than or equal"),
    (["--colocated-replicas", "x"], "--colocated-replicas: must be an integer, got 'x'"),
    (["--port", "70000"], "--port: Input should be less than or equal to 65535 (got 70000)"),
    (["--port", "p"], "--port: must be an integer, got 'p'"),
    (["--http-port", "http"], "--http-port: 'http' is not a port number or 'off'"),
    (["--http-port", "-1"], "--http-port: Input should be greater than or equal to 0 (got -1)"),
    (["--max-model-len", "0"], "--max-model-len: Input should be greater than or equal to 1"),
    (["--model", ""], "--model: String should have at least 1 character"),
    (["--served-model-name", ""], "--served-model-name: each name must be text of 1 to 256"),
    (["--api-key", "short"], "--api-key: API key #1 must have 8 to 512 characters, has 5"),
    (["--http-port", "50051"], "http_port and port are both 50051"),
]


@pytest.mark.parametrize("argv,line", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_value_is_one_line_naming_its_flag(argv, line, capsys):
    assert main(["up", "--check", *argv]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("pdserve: ") and line in err[0], err
    assert argv[0] in err[0]
    assert "short" not in err[0]  # a key, even a refused one, is never shown


def test_a_bad_value_with_a_yaml_names_the_flag_not_the_file(tmp_path, capsys):
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"pools": {"decode": {"tp": 2}, "prefill": {"replicas": 0}}}))
    assert main(["up", str(path), "--check", "--decode-tp", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [  # the YAML's own bad key still names the file
        f"pdserve: {path}: pools.prefill.replicas: Input should be greater than or equal to 1 "
        f"(got 0)",
        "pdserve: --decode-tp: Input should be greater than or equal to 1 (got 0)",
    ]


def test_checks_after_validation_name_the_flag_that_gave_the_value(tmp_path, tiny_models):
    """The checks before the start (here the pools against the model: deploy/config/checks.py)
    name the flag in place of the key it set."""
    from pdserve.engine.loader import load_hf_config

    model_dir, _ = tiny_models("llama-gqa")
    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?")
    add_up_flags(parser)
    args = parser.parse_args(["--model", str(model_dir), "--tp", "3", "--decode-tp", "5"])
    config, flags = up_config(args)
    problems = fit_problems(config, load_hf_config(model_dir), None)
    named = [flags.name(p) for p in problems]
    assert named and all(own for _, own in named)
    assert {line.split(":")[0] for line, _ in named} == {"--decode-tp", "--tp"}
    assert any(line.startswith("--decode-tp: 5 does not divide") for line, _ in named), named


def test_served_model_id_of_a_hub_id_a_local_directory_and_a_name(tmp_path, monkeypatch):
    assert DeployConfig().served_model_id() is None  # the router's default: the file's name
    hub = DeployConfig(model="HuggingFaceTB/SmolLM2-135M-Instruct@main")
    assert hub.served_model_id() == "HuggingFaceTB/SmolLM2-135M-Instruct"
    named = DeployConfig(model="HuggingFaceTB/SmolLM2-135M-Instruct", served_model_name="smol")
    assert named.served_model_id() == "smol"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "HuggingFaceTB" / "SmolLM2-135M-Instruct").mkdir(parents=True)
    assert DeployConfig(model="HuggingFaceTB/SmolLM2-135M-Instruct").served_model_id() is None


def test_a_bad_yaml_with_flags_is_still_named_by_its_file(tmp_path, capsys):
    path = tmp_path / "deploy.yaml"
    path.write_text("pools: [1, 2]\n")
    assert main(["up", str(path), "--check", "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: pools" in err
    with pytest.raises(ConfigError):
        _up(tmp_path, {"pools": [1]}, "--decode-tp", "2")


def test_the_workers_register_under_the_routers_model_id():
    """The router refuses a worker whose model id is not its own (router/registry.py): both take
    served_model_id."""
    from pdserve.deploy.launcher import Cluster, _worker_config

    for config, want in (
        (DeployConfig(model="org/name@v1"), "org/name"),
        (DeployConfig(served_model_name="mine"), "mine"),
        (DeployConfig(), None),
    ):
        cluster = Cluster(config, started_ray=False, registry_address="127.0.0.1:1")
        for key, pool in config.worker_pools():
            assert _worker_config(cluster, key, pool, 0, "127.0.0.1").model_id == want


def test_pipeline_stage_flags(tmp_path):
    c = _up(tmp_path, None, "--prefill-pp", "3", "--prefill-tp", "2")
    assert (c.pools.prefill.pp, c.pools.prefill.tp, c.pools.decode.pp) == (3, 2, 1)


def test_the_trainer_switches_turn_their_keys_on(tmp_path):
    c = _up(tmp_path, YAML, "--pause-endpoints", "--weight-updates")
    assert c.router.pause_endpoints and c.router.weight_updates
    c = _up(tmp_path, {**YAML, "router": {**YAML["router"], "weight_updates": True}})
    assert c.router.weight_updates and not c.router.pause_endpoints  # not given: the YAML's
