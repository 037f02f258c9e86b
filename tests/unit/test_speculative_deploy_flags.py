"""Where a deployment turns speculative decoding on (issue 31): the YAML's
`pools.<pool>.speculative_config` (deploy/config/schema.py), accepted on decode and colocated pools,
refused on a prefill pool, checked key by key with errors that name the key, and handed to the
pool's engine; `pdserve up --speculative-config JSON` over it (pdserve/up_flags.py), set on the
pools that decode; and `pdserve generate --local --speculative-config JSON` (pdserve/cli.py),
checked before any model loads. No socket and no model: nothing here starts a worker."""

from __future__ import annotations

import json

import pytest
import yaml

import pdserve.engine
import pdserve.engine.loader
from helpers.deploy_config import EXAMPLES
from helpers.up import flags_config as _up
from pdserve.cli import main
from pdserve.deploy.config.load import ConfigError, validate_config
from pdserve.deploy.config.schema import DeployConfig
from pdserve.engine.spec.config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
NGRAM_FULL = {**NGRAM, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
DRAFT = {"model": "self", "quantization": "int4", "num_speculative_tokens": 4}
NGRAM_JSON = json.dumps(NGRAM)
FLAG = "--speculative-config"


def _refusal(data: dict) -> str:
    with pytest.raises(ConfigError) as e:
        validate_config(data, "d.yaml")
    return str(e.value)


def _up_refusal(tmp_path, yaml_data: dict | None, *flags: str) -> str:
    with pytest.raises(ConfigError) as e:
        _up(tmp_path, yaml_data, *flags)
    return str(e.value)


# ---- the YAML key -------------------------------------------------------------------------------
def test_a_decode_pool_speculates_and_its_engine_gets_the_checked_mapping():
    config = validate_config({"pools": {"decode": {"speculative_config": NGRAM}}})
    assert config.pools.decode.speculative_config == NGRAM_FULL  # vLLM's defaults filled in
    assert config.engine_kwargs(config.pools.decode)["speculative_config"] == NGRAM_FULL
    # unset: the engine's default ("auto": prompt lookup in the default mode on a CPU)
    assert config.engine_kwargs(config.pools.prefill)["speculative_config"] == "auto"
    assert DeployConfig().engine_kwargs(DeployConfig().pools.decode)["speculative_config"] == "auto"
    off = validate_config({"pools": {"decode": {"speculative_config": None}}})
    assert off.engine_kwargs(off.pools.decode)["speculative_config"] is None


def test_a_colocated_pool_speculates_with_a_draft_model():
    config = validate_config({"pools": {"colocated": {"speculative_config": DRAFT}}})
    kwargs = config.engine_kwargs(config.pools.colocated)
    assert kwargs["speculative_config"] == {
        "method": "draft_model", "num_speculative_tokens": 4, "model": "self", "dtype": "auto",
        "quantization": "int4",
    }  # fmt: skip
    assert SpeculativeConfig.parse(kwargs["speculative_config"]).model == "self"


@pytest.mark.parametrize(
    "head",
    [
        {"method": "eagle3", "model": "/heads/h", "num_speculative_tokens": 3},
        {"method": "mtp", "num_speculative_tokens": 1},
    ],
)
def test_a_decode_pools_eagle_head_runs_on_a_one_rank_prefill_pool_too(head):
    """(Its KV of each prompt travels with the hand-off: engine/spec/eagle.py; an MTP layer's
    too.)"""
    config = validate_config({"pools": {"decode": {"speculative_config": head}}})
    want = config.pools.decode.speculative_config
    assert want["method"] == head["method"] and want["model"] == head.get("model", "self")
    assert config.engine_kwargs(config.pools.prefill)["speculative_config"] == want
    wide = validate_config(
        {"pools": {"decode": {"speculative_config": head}, "prefill": {"tp": 2}}}
    )
    assert wide.engine_kwargs(wide.pools.prefill)["speculative_config"] == want
    staged = validate_config(
        {"pools": {"decode": {"speculative_config": head}, "prefill": {"pp": 2}}}
    )
    assert staged.engine_kwargs(staged.pools.prefill)["speculative_config"] == "auto"


def test_a_prefill_pool_is_refused_a_speculative_config():
    err = _refusal({"pools": {"prefill": {"speculative_config": NGRAM}}})
    assert err.startswith("d.yaml: pools.prefill: speculative_config: prefill workers never decode")
    assert "pools.decode" in err and len(err.splitlines()) == 1
    # null is the default, on a prefill pool too
    assert validate_config({"pools": {"prefill": {"speculative_config": None}}})


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in"),
        ({**NGRAM, "num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer in"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        ({**NGRAM, "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min (5)"),
        ({**NGRAM, "model": "self"}, "model is for method 'draft_model'"),
        ({**DRAFT, "quantization": "int3"}, "quantization must be null, 'int8', 'int4' or 'bf16'"),
        ({**NGRAM, "lookahead": 2}, "has unknown key(s) ['lookahead']"),
        ("ngram", "must be a mapping"),
    ],
)
def test_a_bad_speculative_config_is_refused_naming_the_key(value, says):
    err = _refusal({"pools": {"decode": {"speculative_config": value}}})
    assert err.startswith("d.yaml: pools.decode.speculative_config: ")
    assert says in err and len(err.splitlines()) == 1


def test_the_annotated_example_shows_the_key():
    text = next(p for p in EXAMPLES if p.name == "local-cpu.yaml").read_text()
    line = next(x for x in text.splitlines() if "speculative_config:" in x)
    value = yaml.safe_load(line.strip().removeprefix("#").strip())["speculative_config"]
    assert validate_config({"pools": {"decode": {"speculative_config": value}}})


# ---- pdserve up --speculative-config --------------------------------------------------------------
def test_the_up_flag_sets_the_decode_pool_only(tmp_path):
    config = _up(tmp_path, None, FLAG, NGRAM_JSON)
    assert config.pools.decode.speculative_config == NGRAM_FULL
    assert config.pools.prefill.speculative_config == "auto"  # left as it was


def test_the_up_flag_sets_a_colocated_pool(tmp_path):
    colocated = {"pools": {"colocated": {"replicas": 2}}}
    config = _up(tmp_path, colocated, FLAG, json.dumps(DRAFT))
    assert config.pools.colocated.speculative_config["model"] == "self"
    config = _up(tmp_path, None, "--colocated-replicas", "1", FLAG, NGRAM_JSON)
    assert config.pools.colocated.speculative_config == NGRAM_FULL


def test_the_up_flag_wins_over_the_yaml_and_null_turns_it_off(tmp_path):
    data = {"pools": {"decode": {"speculative_config": DRAFT}}}
    assert _up(tmp_path, data).pools.decode.speculative_config["model"] == "self"
    assert _up(tmp_path, data, FLAG, "null").pools.decode.speculative_config is None
    flagged = _up(tmp_path, data, FLAG, NGRAM_JSON)
    assert flagged.pools.decode.speculative_config == NGRAM_FULL


def test_the_up_flag_refuses_bad_json_in_one_line_naming_the_flag(tmp_path, capsys):
    err = _up_refusal(tmp_path, None, FLAG, "{method: ngram}")
    assert err.startswith("--speculative-config: not valid JSON (") and len(err.splitlines()) == 1
    assert main(["up", "--check", FLAG, "{method: ngram}"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve: --speculative-config: not valid JSON")


def test_the_up_flag_refuses_a_bad_value_naming_the_flag(tmp_path):
    err = _up_refusal(tmp_path, None, FLAG, json.dumps({**NGRAM, "num_speculative_tokens": 99}))
    assert err == f"{FLAG}: num_speculative_tokens must be an integer in [1, 16], got 99"
    err = _up_refusal(tmp_path, None, FLAG, "4")
    assert err.startswith("--speculative-config: must be a mapping")


# ---- pdserve generate --local --speculative-config ----------------------------------------------
class _Stop(ValueError):
    """Raised by the stand-in LLM once it has the kwargs: no model loads."""


def test_generate_local_hands_the_checked_config_to_the_engine(monkeypatch, capsys):
    seen = {}

    def fake_llm(model, **kwargs):
        seen.update(kwargs)
        raise _Stop("stand-in engine")

    monkeypatch.setattr(pdserve.engine, "LLM", fake_llm)
    # (`generate --local` finds the model before the engine's imports: here, no model)
    monkeypatch.setattr(pdserve.engine.loader, "resolve_model", lambda model: model)
    assert main(["generate", "hi", "--local", FLAG, NGRAM_JSON]) == 2
    assert seen["speculative_config"] == SpeculativeConfig.parse(NGRAM)
    assert capsys.readouterr().err.strip() == "pdserve: stand-in engine"
    seen.clear()
    assert main(["generate", "hi", "--local"]) == 2
    assert "speculative_config" not in seen  # unset: the engine's default (off)


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("{bad", "not valid JSON ("),
        (json.dumps({**NGRAM, "num_speculative_tokens": 0}), "num_speculative_tokens must be"),
        (json.dumps({**NGRAM, "x": 1}), "has unknown key(s) ['x']"),
    ],
)
def test_generate_local_refuses_a_bad_config_before_loading(monkeypatch, capsys, flag, says):
    monkeypatch.setattr(pdserve.engine, "LLM", lambda *a, **k: pytest.fail("a model loaded"))
    assert main(["generate", "hi", "--local", FLAG, flag]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pdserve: {FLAG}: {says}")


def test_the_generate_flag_is_for_local_only(capsys):
    assert main(["generate", "hi", FLAG, "{}"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "--speculative-config is for --local" in lines[0]
