"""The deployment YAML's HTTP front and client API keys (deploy/config/schema.py, deploy/launcher.py,
pdserve/cli.py): router.http_port, router.api_keys / api_keys_file / PDSERVE_API_KEYS (first found
wins), refusals that name the key without showing it, and the interceptor's key check itself."""

from __future__ import annotations

import argparse
import logging

import pytest

from pdserve.deploy.config.load import ConfigError, load_config, validate_config
from pdserve.deploy.config.schema import DeployConfig
from pdserve.deploy.launcher import client_keys
from pdserve.protos.security import ClientKeys, bearer_token
from pdserve.up_flags import add_up_flags, up_config

KEY, KEY2 = "sk-config-key-0001", "sk-config-key-0002"


def test_http_port_default_off_free_and_refusals():
    assert DeployConfig().router.http_port == 8000
    assert validate_config({"router": {"http_port": None}}).router.http_port is None
    assert validate_config({"router": {"http_port": 0, "port": 0}}).router.http_port == 0
    # a free gRPC port: a free HTTP port too unless one is given
    assert validate_config({"router": {"port": 0}}).router.http_port == 0
    assert validate_config({"router": {"port": 0, "http_port": 8001}}).router.http_port == 8001
    assert validate_config({"router": {"port": 9000}}).router.http_port == 8000
    for bad, named in (
        ({"http_port": 70000}, "router.http_port"),
        ({"http_port": "8000"}, "router.http_port"),
        ({"http_port": 50051}, "need a port each"),
        ({"http_port": 9000, "port": 9000}, "need a port each"),
    ):
        with pytest.raises(ConfigError) as e:
            validate_config({"router": bad})
        assert named in str(e.value)


def _with_http_port(value: str) -> DeployConfig:
    """The default deployment with `pdserve up --http-port value` (pdserve/up_flags.py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?")
    add_up_flags(parser)
    return up_config(parser.parse_args(["--http-port", value]))[0]


def test_http_port_flag_overrides_the_yaml_and_is_checked_like_it():
    assert _with_http_port("9001").router.http_port == 9001
    assert _with_http_port("off").router.http_port is None
    assert _with_http_port("0").router.http_port == 0
    for bad in ("http", "70000", "50051"):
        with pytest.raises(ConfigError) as e:
            _with_http_port(bad)
        assert "--http-port" in str(e.value)


def test_api_keys_first_found_wins_file_yaml_env(tmp_path):
    env = {"PDSERVE_API_KEYS": f" {KEY} ,{KEY2}"}
    assert DeployConfig().router.client_keys({}) == ((), "")
    assert DeployConfig().router.client_keys(env) == ((KEY, KEY2), "PDSERVE_API_KEYS")
    yaml_keys = validate_config({"router": {"api_keys": [KEY2]}})
    assert yaml_keys.router.client_keys(env) == ((KEY2,), "router.api_keys")
    (tmp_path / "keys.txt").write_text(f"# the team's keys\n{KEY}\n\n{KEY2}\n")
    (tmp_path / "deploy.yaml").write_text("router:\n  api_keys_file: keys.txt\n")
    keys, source = load_config(tmp_path / "deploy.yaml").router.client_keys(env)
    assert keys == (KEY, KEY2) and source.startswith("router.api_keys_file")


@pytest.mark.parametrize(
    "keys",
    [["short"], ["has space inside"], ["comma,inside-key"], ["é-not-ascii-key"], []],
    ids=["short", "space", "comma", "non-ascii", "empty-list"],
)
def test_bad_keys_are_refused_without_being_shown(keys):
    with pytest.raises(ConfigError) as e:
        validate_config({"router": {"api_keys": keys}})
    assert "router.api_keys" in str(e.value)
    assert all(k not in str(e.value) for k in keys)


def test_bad_keys_file_and_env_are_refused_without_being_shown(tmp_path):
    (tmp_path / "keys.txt").write_text("# nothing but comments\n\n")
    (tmp_path / "deploy.yaml").write_text("router:\n  api_keys_file: keys.txt\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "deploy.yaml")
    assert "router.api_keys_file" in str(e.value) and "no API key" in str(e.value)
    with pytest.raises(ConfigError) as e:
        client_keys(DeployConfig(), {"PDSERVE_API_KEYS": f"{KEY},bad key!"})
    assert "PDSERVE_API_KEYS" in str(e.value) and KEY not in str(e.value)
    with pytest.raises(ConfigError):
        validate_config({"router": {"api_keys": [KEY], "api_keys_file": "x"}})


def test_keys_never_in_a_repr_or_a_log_line(caplog):
    caplog.set_level(logging.DEBUG)
    config = validate_config({"router": {"api_keys": [KEY, KEY2]}})
    assert KEY not in repr(config) and KEY not in str(config.model_dump())
    assert client_keys(config, {}) == (KEY, KEY2)
    assert "client API keys: 2 from router.api_keys" in caplog.text
    assert KEY not in caplog.text and KEY2 not in caplog.text
    assert repr(ClientKeys((KEY,))) == "ClientKeys(1 key)"


def test_client_keys_accept_only_their_keys():
    keys = ClientKeys((KEY, KEY2))
    assert keys.accepts(KEY) and keys.accepts(KEY2.encode())
    assert not keys.accepts(None) and not keys.accepts(KEY[:-1]) and not keys.accepts(KEY + "x")
    assert keys.accepts_header(f"Bearer {KEY}") and keys.accepts_header(f"bearer  {KEY2} ")
    for header in (None, KEY, f"Basic {KEY}", "Bearer", "Bearer ", f"Bearer{KEY}"):
        assert not keys.accepts_header(header), header
    assert ClientKeys().accepts(None) and ClientKeys().accepts_header(None)  # no keys: open
    assert bearer_token(b"Bearer abc") == b"abc"


def test_up_prints_the_grpc_and_the_http_address(monkeypatch, capsys):
    """`pdserve up` prints both fronts' addresses once the deployment is up (the launcher and the
    checks before it are stubbed: the real ones run in tests/e2e), with --http-port passed
    through."""
    from pdserve.cli import main
    from pdserve.deploy import launcher, prechecks

    seen = {}

    class Up:
        router_address = "127.0.0.1:50051"
        http_url = "http://127.0.0.1:9100"

        def wait(self):
            return "interrupted"

        def start_table(self):  # the workers' table (deploy/start_table.py): none here
            return ""

    def fake_up(config, address=None, block=True):
        seen["http_port"] = config.router.http_port
        return Up()

    monkeypatch.setattr(launcher, "up", fake_up)
    # the checks before the start probe the ports (tests/integration/test_up_check_same_refusals.py)
    monkeypatch.setattr(prechecks, "preflight", lambda config, address=None: [])
    assert main(["up", "--http-port", "9100"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert seen == {"http_port": 9100}
    assert out[:3] == [  # then the workers' table (deploy/start_table.py)
        "router on 127.0.0.1:50051",
        "OpenAI-compatible HTTP on http://127.0.0.1:9100/v1",
        "ready",
    ]
    assert main(["up", "--http-port", "nope"]) == 2
    assert "--http-port" in capsys.readouterr().err
