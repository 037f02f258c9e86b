"""Deployment YAML files written for a test, and the ConfigError that loading one raises."""

from __future__ import annotations

import pytest

from pdserve.deploy.config import ConfigError, load_config


def write(tmp_path, text: str, name: str = "deploy.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error_of(path: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path)
    return str(e.value)
