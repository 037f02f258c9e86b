"""Deployment YAML files written for a test, the ConfigError that loading one raises, and the
shipped examples (deploy/examples/), of which those on GPUs are checked against the config.json of
models absent here and the others against the real SmolLM2."""

from __future__ import annotations

import pathlib

import pytest

from pdserve.deploy.config.load import ConfigError, load_config


def write(tmp_path, text: str, name: str = "deploy.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error_of(path: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path)
    return str(e.value)


EXAMPLES = sorted((pathlib.Path(__file__).parents[2] / "deploy" / "examples").glob("*.yaml"))


def on_gpus(path) -> bool:
    """Whether the pools of the deployment YAML at `path` ask for GPUs."""
    return any(p.resources.num_gpus for _, p in load_config(str(path)).worker_pools())


def router_config_of(config, monkeypatch, security=None):
    """The RouterConfig `pdserve up` builds for the validated DeployConfig `config`
    (deploy/launcher.py _start_router), caught before a router starts."""
    from types import SimpleNamespace

    from pdserve.deploy import launcher
    from pdserve.protos.security import ClusterSecurity
    from pdserve.router import server

    class Started(Exception):
        pass

    def router(router_config):
        raise Started(router_config)

    with monkeypatch.context() as patch:
        patch.setattr(server, "Router", router)
        cluster = SimpleNamespace(
            config=config,
            security=security if security is not None else ClusterSecurity(),
            deployment_id="d",
        )
        with pytest.raises(Started) as e:
            launcher._start_router(cluster)
    return e.value.args[0]
