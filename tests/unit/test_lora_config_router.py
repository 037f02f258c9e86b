"""LoRA's settings and the router's side of it, without a cluster: the lora.* YAML keys and
vLLM's flags of `pdserve up` (deploy/config/schema.py, pdserve/up_flags.py) and the engine's
own fields (engine/config.py), each bad value refused naming it; the router's names, model
cards and run-time load/unload over fake workers (router/lora.py), a worker's refusal undoing
the load on the workers that took it; prefix affinity keyed on the adapter (router/affinity.py)."""

from __future__ import annotations

import argparse

import grpc
import pytest

from helpers.deploy_config import router_config_of
from helpers.rpc import Refused
from pdserve.deploy.config.load import ConfigError, validate_config
from pdserve.engine import EngineConfig
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.affinity import prefix_hashes
from pdserve.router.lora import AdapterCallError, RouterAdapters
from pdserve.up_flags import add_up_flags, up_config


def _up(*argv):
    p = argparse.ArgumentParser()
    p.add_argument("config", nargs="?")
    add_up_flags(p)
    return up_config(p.parse_args(list(argv)))[0]


def test_flags_and_keys_reach_every_worker_engine():
    config = _up("--enable-lora", "--lora-modules", "sql=/a/sql", '{"name": "poem", "path": "/b"}',
                 "--max-loras", "3", "--max-lora-rank", "32")  # fmt: skip
    assert config.lora.modules == {"sql": "/a/sql", "poem": "/b"}
    for _, pool in config.worker_pools():
        kw = config.engine_kwargs(pool)
        assert kw["enable_lora"] and kw["max_loras"] == 3 and kw["max_lora_rank"] == 32
        assert kw["lora_modules"] == {"sql": "/a/sql", "poem": "/b"}
    assert "enable_lora" not in _up().engine_kwargs(_up().pools.decode)


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--lora-modules", "sql=/a"], ["--lora-modules", "lora.enabled"]),
        (["--enable-lora", "--max-lora-rank", "0"], ["--max-lora-rank"]),
        (["--enable-lora", "--max-loras", "x"], ["--max-loras", "integer"]),
        (["--enable-lora", "--lora-modules", "noequals"], ["--lora-modules", "name=path"]),
        (["--enable-lora", "--lora-modules", "a b=/a"], ["lora_name"]),
    ],
)
def test_bad_flags_refused_naming_the_flag(argv, words):
    with pytest.raises(ConfigError) as e:
        _up(*argv)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_yaml_keys_checked():
    ok = validate_config({"lora": {"enabled": True, "modules": {"a": "/x"}}}, "t.yaml")
    assert ok.lora.max_loras == 1 and ok.lora.max_lora_rank == 16
    assert not ok.lora.allow_runtime_updates
    for bad, word in (
        ({"enabled": True, "modules": {"bad name": "/x"}}, "lora_name"),
        ({"allow_runtime_updates": True}, "lora.enabled"),
        ({"enabled": True, "max_lora_rank": 2048}, "max_lora_rank"),
        ({"enabled": True, "nope": 1}, "nope"),
    ):
        with pytest.raises(ConfigError, match=word):
            validate_config({"lora": bad}, "t.yaml")


def test_engine_config_fields():
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        EngineConfig(model="m", lora_modules={"a": "/x"})
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(model="m", enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="lora_modules"):
        EngineConfig(model="m", enable_lora=True, lora_modules={"a": 3})
    cfg = EngineConfig(model="m", enable_lora=True, lora_modules={"a": "/x"})
    assert cfg.lora_modules == (("a", "/x"),)


def test_affinity_keys_on_the_adapter():
    prompt = list(range(100))
    base = prefix_hashes(prompt)
    assert base == prefix_hashes(prompt, adapter="")
    a, b = prefix_hashes(prompt, adapter="a"), prefix_hashes(prompt, adapter="b")
    assert len(a) == len(base) == 3
    assert not set(a) & set(base) and not set(a) & set(b)


class _Stub:
    def __init__(self, refuse=None):
        self.calls, self.refuse = [], refuse

    def LoadLoRA(self, request, timeout):
        self.calls.append(("load", request.lora_name, request.lora_path))
        if self.refuse:
            raise Refused(*self.refuse)

    def UnloadLoRA(self, request, timeout):
        self.calls.append(("unload", request.lora_name))


class _Worker:
    def __init__(self, name, stub):
        self.name, self.stub = name, stub


class _Pool:
    def __init__(self, *workers):
        self.workers = list(workers)

    def members(self):
        return self.workers

    def name(self, worker):
        return worker.name


def test_names_and_cards():
    loras = RouterAdapters("base", True, (("sql", "/a"),))
    assert loras.adapter_for("") == loras.adapter_for("base") == ""
    assert loras.adapter_for("sql") == "sql" and loras.adapter_for("nope") is None
    card = pdserve_pb2.ModelCard(id="base", max_model_len=64, root="org/base")
    cards = loras.cards(card)
    assert [(c.id, c.parent, c.root, c.max_model_len) for c in cards] == [
        ("base", "", "org/base", 64),
        ("sql", "base", "/a", 64),
    ]
    assert RouterAdapters("base").adapter_for("sql") is None  # off: only the base


def test_aliases_name_the_base_model_and_each_has_a_card():
    """vLLM's several --served-model-name: each alias runs the base model and is listed."""
    loras = RouterAdapters("base", True, (("sql", "/a"),), aliases=("b2", "b3"))
    assert loras.adapter_for("b2") == loras.adapter_for("b3") == ""
    assert loras.served() == ["base", "b2", "b3", "sql"]
    card = pdserve_pb2.ModelCard(id="base", max_model_len=64, root="org/base")
    assert [(c.id, c.parent, c.root) for c in loras.cards(card)] == [
        ("base", "", "org/base"),
        ("b2", "", "org/base"),
        ("b3", "", "org/base"),
        ("sql", "base", "/a"),
    ]
    loras.allow_runtime_updates = True
    with pytest.raises(AdapterCallError) as e:
        loras.load("b2", "/elsewhere")
    assert e.value.status == 400 and "names the base model" in e.value.message
    assert loras.adapter_for("b2") == ""  # still the base model's


def test_served_model_name_lists_are_checked(monkeypatch):
    ok = validate_config({"served_model_name": ["m", "m-alias"]})
    assert (ok.served_model_id(), ok.served_model_aliases()) == ("m", ("m-alias",))
    router = router_config_of(ok, monkeypatch)
    assert (router.model_id, router.model_aliases) == ("m", ("m-alias",))
    assert validate_config({"served_model_name": "m"}).served_model_aliases() == ()
    for bad, words in (
        ([], "must be a name or a list of names"),
        (["m", ""], "each name must be text of 1 to 256 characters"),
        (3, "must be a name or a list of names"),
        ([f"m{i}" for i in range(65)], "at most 64 names, got 65"),
        (["m", "n", "m"], "served_model_name names ['m'] more than once"),
    ):
        with pytest.raises(ConfigError) as e:
            validate_config({"served_model_name": bad})
        assert words in str(e.value), e.value
    with pytest.raises(ConfigError) as e:
        validate_config(
            {
                "served_model_name": ["m", "sql"],
                "lora": {"enabled": True, "modules": {"sql": "/a"}},
            }
        )
    assert "served_model_name and lora.modules both name ['sql']" in str(e.value), e.value


def test_load_tells_every_worker_and_undoes_a_refused_one():
    good, bad = _Stub(), _Stub(refuse=(grpc.StatusCode.INVALID_ARGUMENT, "rank r=64 too big"))
    pool = _Pool(_Worker("d0", good), _Worker("p0", bad))
    loras = RouterAdapters("base", True, (), allow_runtime_updates=True, pool=pool)
    with pytest.raises(AdapterCallError) as e:
        loras.load("big", "/adapters/big")
    assert e.value.status == 400 and e.value.param == "lora_path" and "p0" in e.value.message
    assert good.calls == [("load", "big", "/adapters/big"), ("unload", "big")]
    assert loras.adapter_for("big") is None
    bad.refuse = None
    loras.load("big", "/adapters/big")
    assert loras.adapter_for("big") == "big"
    loras.unload("big")
    assert loras.adapter_for("big") is None and good.calls[-1] == ("unload", "big")
    with pytest.raises(AdapterCallError) as e:
        loras.unload("big")
    assert e.value.status == 404
    for name, path, param in (("", "/x", "lora_name"), ("a b", "/x", "lora_name"),
                              ("ok", "x" * 5000, "lora_path"), ("base", "/x", "lora_name")):  # fmt: skip
        with pytest.raises(AdapterCallError) as e:
            loras.load(name, path)
        assert e.value.status == 400 and e.value.param == param


def test_load_off_unless_enabled_and_allowed():
    pool = _Pool(_Worker("d0", _Stub()))
    for loras in (
        RouterAdapters("base", False, pool=pool),
        RouterAdapters("base", True, allow_runtime_updates=False, pool=pool),
    ):
        with pytest.raises(AdapterCallError) as e:
            loras.load("a", "/a")
        assert e.value.status == 404
        with pytest.raises(AdapterCallError) as e:
            loras.unload("a")
        assert e.value.status == 404
    assert pool.workers[0].stub.calls == []
