"""The router's scheduling policy, stream interval and embedding keys in the deployment YAML and
on `pdserve up`'s command line: `--scheduling-policy` and `--stream-interval` over the YAML's
keys, the defaults (fcfs, 1, last-token pooling, normalised), and bad values refused naming the
flag or the key."""

from __future__ import annotations

import pytest

from helpers.deploy_config import error_of, write
from helpers.up import flags_config as _up
from pdserve.cli import main
from pdserve.router.server import RouterConfig


def test_defaults_and_the_flag_over_the_yaml(tmp_path):
    c = _up(tmp_path, None)
    assert (c.router.scheduling_policy, c.router.embedding_pooling) == ("fcfs", "last")
    assert c.router.embedding_normalize is True
    yaml = {"router": {"scheduling_policy": "priority", "embedding_pooling": "mean"}}
    assert _up(tmp_path, yaml).router.scheduling_policy == "priority"
    assert _up(tmp_path, yaml, "--scheduling-policy", "fcfs").router.scheduling_policy == "fcfs"
    assert _up(tmp_path, None, "--scheduling-policy", "priority").router.scheduling_policy == (
        "priority"
    )


def test_the_stream_interval_flag_over_the_yaml_and_its_bounds(tmp_path, capsys):
    assert _up(tmp_path, None).router.stream_interval == 1
    yaml = {"router": {"stream_interval": 8}}
    assert _up(tmp_path, yaml).router.stream_interval == 8
    assert _up(tmp_path, yaml, "--stream-interval", "2").router.stream_interval == 2
    assert main(["up", "--check", "--stream-interval", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--stream-interval" in err[0] and "1" in err[0], err
    with pytest.raises(ValueError, match="stream_interval"):
        RouterConfig(model="m", stream_interval=0)


def test_a_bad_policy_on_the_command_line_names_the_flag(capsys):
    assert main(["up", "--check", "--scheduling-policy", "lifo"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--scheduling-policy" in err[0] and "fcfs" in err[0], err


@pytest.mark.parametrize(
    "text, key",
    [
        ("router:\n  scheduling_policy: lifo\n", "router.scheduling_policy"),
        ("router:\n  embedding_pooling: cls\n", "router.embedding_pooling"),
        ("router:\n  embedding_normalize: 1\n", "router.embedding_normalize"),
    ],
)
def test_bad_yaml_values_name_the_key(tmp_path, text, key):
    assert key in error_of(write(tmp_path, text))


def test_router_config_refuses_what_the_schema_would():
    with pytest.raises(ValueError, match="scheduling_policy"):
        RouterConfig(model="m", scheduling_policy="lifo")
    with pytest.raises(ValueError, match="embedding_pooling"):
        RouterConfig(model="m", embedding_pooling="cls")
