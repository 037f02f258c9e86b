"""A model's generation_config.json (engine/loader/generation_config.py), as vLLM's
`--generation-config` reads it: its extra end-of-sequence ids end a sequence in the engine
(engine/config.py ModelConfig.from_hf; vLLM folds them into stop_token_ids), under every mode,
unless ignore_eos and never before min_tokens; its sampling fields (vLLM's list, max_new_tokens
as max_tokens) are the defaults of "auto" and of a folder named as the mode, none under "vllm".
A model's file that is absent, too large or not a JSON object gives nothing and no error; a
folder named as the mode must hold one."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
from transformers import AutoConfig

from helpers.deploy_config import router_config_of
from helpers.engine import KV
from helpers.models import hf_greedy, random_prompts
from pdserve.engine import LLM, EngineConfig, ModelConfig, SamplingParams
from pdserve.engine.loader import generation_config as gc

EOS = 1  # the tiny models' config.json eos_token_id


def write(folder, config) -> None:
    text = config if isinstance(config, str) else json.dumps(config)
    (folder / gc.FILE_NAME).write_text(text)


@pytest.fixture
def model_dir(tiny_models, tmp_path):
    """A copy of the tiny llama's folder, whose generation_config.json a test may rewrite."""
    src, _ = tiny_models("llama-gqa")
    return shutil.copytree(src, tmp_path / "model")


def test_the_sampling_fields_are_vllms_list_with_max_new_tokens_as_max_tokens(tmp_path):
    write(
        tmp_path,
        {
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "max_new_tokens": 256,
            "do_sample": True,  # not one of vLLM's fields: ignored, as there
            "presence_penalty": 1.5,
            "eos_token_id": [1, 7],
        },
    )
    assert gc.default_sampling_params(tmp_path) == {
        "repetition_penalty": 1.1,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "min_p": 0.05,
        "max_tokens": 256,
    }
    assert gc.default_sampling_params(tmp_path, "vllm") == {}  # vLLM's neutral defaults
    assert gc.default_sampling_params("/nowhere", str(tmp_path))["temperature"] == 0.6
    assert gc.eos_token_ids(tmp_path) == (1, 7)
    assert gc.eos_token_ids(tmp_path, "vllm") == (1, 7)  # vLLM reads them under "vllm" too


@pytest.mark.parametrize(
    "text",
    [None, "{not json", "[1, 2]", '"a string"', " " * (gc.MAX_FILE_BYTES + 1), b"\xff\xfe"],
    ids=["absent", "bad-json", "a-list", "a-string", "too-large", "not-utf8"],
)
def test_a_models_file_that_cannot_be_read_gives_nothing_and_no_error(tmp_path, text):
    if isinstance(text, bytes):
        (tmp_path / gc.FILE_NAME).write_bytes(text)
    elif text is not None:
        write(tmp_path, text)
    assert gc.default_sampling_params(tmp_path) == {}
    assert gc.eos_token_ids(tmp_path) == ()
    assert gc.default_sampling_params(None) == {}  # a config not read from a folder


def test_a_folder_named_as_the_mode_must_hold_a_readable_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist: name a folder holding"):
        gc.default_sampling_params("/model", str(tmp_path))
    write(tmp_path, "{not json")
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        gc.eos_token_ids("/model", str(tmp_path))
    for bad in ("", "  ", None, 3):
        with pytest.raises(ValueError, match="generation_config must be 'auto'"):
            gc.check_mode(bad)
        with pytest.raises(ValueError, match="generation_config must be 'auto'"):
            EngineConfig(model="m", generation_config=bad)


def test_values_no_request_could_carry_are_left_out(tmp_path):
    write(
        tmp_path,
        {
            "temperature": -1,
            "top_p": 2.0,
            "top_k": 40.0,  # an integral float: the integer
            "min_p": "0.1",
            "repetition_penalty": True,
            "max_new_tokens": 0,
            "eos_token_id": [1, -3],
        },
    )
    assert gc.default_sampling_params(tmp_path) == {"top_k": 40}
    assert gc.eos_token_ids(tmp_path) == ()


def test_the_model_config_adds_the_files_eos_ids_after_config_jsons(model_dir, tmp_path):
    write(model_dir, {"eos_token_id": [7, EOS, 9, 7, 999]})  # 999: past the 256-token vocabulary
    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(str(model_dir)))
    assert mc.eos_token_ids == (EOS, 7, 9) and mc.generation_eos_token_ids == (7, 9)
    assert ModelConfig.from_hf(
        AutoConfig.from_pretrained(str(model_dir)), "vllm"
    ).eos_token_ids == (
        EOS,
        7,
        9,
    )
    other = tmp_path / "other"
    other.mkdir()
    write(other, {"eos_token_id": 5})
    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(str(model_dir)), str(other))
    assert mc.eos_token_ids == (EOS, 5)
    (model_dir / gc.FILE_NAME).unlink()  # a GGUF-converted folder has none
    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(str(model_dir)))
    assert mc.eos_token_ids == (EOS,) and mc.generation_eos_token_ids == ()


def test_the_engine_stops_at_an_eos_id_only_generation_config_lists(
    model_dir, tiny_models, one_thread
):
    _, hf = tiny_models("llama-gqa")
    prompt = random_prompts([12], seed=46)[0]
    ref = hf_greedy(hf, prompt, 12)  # the greedy continuation: find a token it emits
    k = next(i for i in range(2, 12) if ref[i] != EOS and ref[i] not in ref[:i])
    extra = ref[k]
    write(model_dir, {"eos_token_id": [EOS, extra], "bos_token_id": 0})
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=KV, max_num_batched_tokens=64)

    def run(**kw):
        params = SamplingParams(temperature=0, max_tokens=12, **kw)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]

    out = run()
    assert out.token_ids == ref[: k + 1] and out.finish_reason == "stop"
    assert out.stop_reason == extra  # as vLLM reports it
    assert not out.text.endswith(f"t{extra}")  # an end-of-sequence token's text is left out
    assert run(ignore_eos=True).token_ids == ref  # ignore_eos: vLLM stops at neither
    held = run(min_tokens=k + 1)  # min_tokens holds it back as it holds back EOS
    assert held.token_ids[:k] == ref[:k] and held.token_ids[k] != extra


def test_the_offline_default_sampling_params_are_the_models(tmp_path, tiny_models):
    """LLM.get_default_sampling_params (vLLM's), which generate and chat use when given none:
    the model's generation_config.json's sampling fields, none under generation_config="vllm"."""
    model_dir = tmp_path / "tiny"
    shutil.copytree(tiny_models("llama-gqa")[0], model_dir)
    write(model_dir, {"temperature": 0.6, "top_k": 20, "max_new_tokens": 7})
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=KV)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_k, default.max_tokens) == (0.6, 20, 7)
    out = llm.generate([5, 6, 7], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 7  # the model's max_new_tokens, with no SamplingParams given
    llm.shutdown()
    plain = LLM(str(model_dir), dtype="float32", kv_cache_memory=KV, generation_config="vllm")
    assert plain.get_default_sampling_params().temperature == 1.0
    plain.shutdown()


def test_the_deployment_key_and_flag_reach_the_router_and_every_engine(monkeypatch):
    """`generation_config` (YAML) and `--generation-config` (vLLM's flag) set RouterConfig's
    (deploy/launcher.py) and every worker's EngineConfig's (DeployConfig.engine_kwargs)."""
    import argparse

    from pdserve.deploy.config.load import validate_config
    from pdserve.up_flags import add_up_flags, up_config

    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?")
    add_up_flags(parser)
    cfg = up_config(parser.parse_args(["--generation-config", "vllm"]))[0]
    assert cfg.generation_config == "vllm" and validate_config({}).generation_config == "auto"
    for _, pool in cfg.worker_pools():
        assert cfg.engine_kwargs(pool)["generation_config"] == "vllm"
        EngineConfig(model="m", **cfg.engine_kwargs(pool))  # a keyword the engine takes
    assert router_config_of(cfg, monkeypatch).generation_config == "vllm"


def test_an_override_is_laid_over_the_files_fields_as_vllm_lays_it(tmp_path):
    """vLLM's --override-generation-config: its fields win over the file's and the others stay;
    under "vllm" it is all there is; a field no generation config sets, or a value no request
    could carry, is refused (a deployment's own setting, not a model's file)."""
    write(tmp_path, {"temperature": 0.6, "top_k": 20})
    override = {"temperature": 0.2, "max_new_tokens": 5.0}
    assert gc.default_sampling_params(tmp_path, "auto", override) == {
        "temperature": 0.2,
        "top_k": 20,
        "max_tokens": 5,
    }
    assert gc.default_sampling_params(tmp_path, "vllm", override) == {
        "temperature": 0.2,
        "max_tokens": 5,
    }
    assert gc.default_sampling_params(tmp_path, "vllm", {}) == {}
    for bad, words in (
        ({"max_tokens": 5}, "'max_tokens' is not a sampling default a generation config sets"),
        ({"temperature": -1}, "temperature must be a number >= 0, got '-1'"),
        ({"top_p": "0.5"}, "top_p must be a number in (0, 1], got '0.5'"),
        ([("top_k", 5)], "must be a JSON object"),
    ):
        with pytest.raises(ValueError) as e:
            gc.check_override(bad, "override_generation_config")
        assert str(e.value).startswith("override_generation_config: ") and words in str(e.value)


def test_the_override_key_and_flag_reach_the_routers_defaults(monkeypatch, model_dir):
    """`override_generation_config` (YAML) and `--override-generation-config` (vLLM's flag) set
    RouterConfig's (deploy/launcher.py), whose defaults the router gives every request that
    leaves a field unset (router/server.py service_options); a bad one is refused at load."""
    import argparse

    from pdserve.deploy.config.load import ConfigError, validate_config
    from pdserve.router.server import service_options
    from pdserve.up_flags import add_up_flags, up_config

    write(pathlib.Path(model_dir), {"temperature": 0.6, "top_k": 20})
    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?")
    add_up_flags(parser)
    flag = ["--model", str(model_dir), "--override-generation-config", '{"temperature": 0.3}']
    cfg = up_config(parser.parse_args(flag))[0]
    assert cfg.override_generation_config == {"temperature": 0.3}
    router = router_config_of(cfg, monkeypatch)
    assert router.override_generation_config == (("temperature", 0.3),)
    defaults = dict(service_options(router, model_dir).sampling_defaults)
    assert defaults == {"temperature": 0.3, "top_k": 20}
    with pytest.raises(ConfigError) as e:
        validate_config({"override_generation_config": {"temprature": 0.3}})
    assert "override_generation_config" in str(e.value) and "'temprature'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        up_config(parser.parse_args(["--override-generation-config", "[1]"]))
    assert str(e.value).startswith("--override-generation-config: a JSON object"), e.value


def test_the_offline_llm_takes_vllms_override_generation_config(tmp_path, tiny_models):
    """LLM(override_generation_config=...) (vLLM's EngineArgs keyword): its fields over the
    model file's in get_default_sampling_params; a bad one is a ValueError naming it."""
    model_dir = tmp_path / "tiny"
    shutil.copytree(tiny_models("llama-gqa")[0], model_dir)
    write(model_dir, {"temperature": 0.6, "top_k": 20})
    override = {"temperature": 0.1, "max_new_tokens": 3}
    llm = LLM(
        str(model_dir), dtype="float32", kv_cache_memory=KV, override_generation_config=override
    )
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_k, default.max_tokens) == (0.1, 20, 3)
    assert len(llm.generate([5, 6, 7], use_tqdm=False)[0].outputs[0].token_ids) == 3
    llm.shutdown()
    with pytest.raises(ValueError, match="override_generation_config: 'seed' is not a sampling"):
        LLM(str(model_dir), override_generation_config={"seed": 1})
