"""router.metrics_keys_file (deploy/config/schema.py): the metrics scrape's own keys, read at load, refused
when empty, malformed or shared with the client API keys, never shown in an error. What GET
/metrics does with them: tests/integration/test_metrics_scrape.py."""

from __future__ import annotations

import pytest

from pdserve.deploy.config.load import ConfigError, load_config


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_scrape_keys_come_from_their_file(tmp_path):
    write(tmp_path, "metrics.keys", "# Prometheus\nsk-metrics-key-0001\n")
    cfg = load_config(write(tmp_path, "c.yaml", "router: {metrics_keys_file: metrics.keys}\n"))
    assert cfg.router.metrics_keys() == ("sk-metrics-key-0001",)
    assert cfg.router.client_keys({}) == ((), "")  # the client API stays as it was: open
    assert "sk-metrics-key-0001" not in repr(cfg)
    assert load_config(write(tmp_path, "d.yaml", "router: {}\n")).router.metrics_keys() == ()


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        ("# none\n", "holds no API key"),
        ("sk-client-key-0001\n", "metrics_keys_file: 1 of its keys are client API keys too"),
    ],
)
def test_bad_scrape_keys_are_refused_naming_the_key(tmp_path, keys, says):
    write(tmp_path, "metrics.keys", keys)
    text = "router: {metrics_keys_file: metrics.keys, api_keys: [sk-client-key-0001]}\n"
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "c.yaml", text))
    assert says in str(e.value) and "router" in str(e.value)
    assert "sk-client-key-0001" not in str(e.value)


def test_a_missing_keys_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"router\.metrics_keys_file: .*nowhere\.keys"):
        load_config(write(tmp_path, "c.yaml", "router: {metrics_keys_file: nowhere.keys}\n"))
