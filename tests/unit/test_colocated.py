"""Colocated serving's deployment YAML: `pools.colocated` instead of prefill/decode. The router in
front of colocated workers: tests/integration/test_colocated_cluster.py."""

from __future__ import annotations

import pytest

from pdserve.deploy.config.load import ConfigError, validate_config


def test_yaml_colocated_pool():
    config = validate_config({"pools": {"colocated": {"replicas": 2, "tp": 1}}})
    assert [key for key, _ in config.worker_pools()] == ["colocated"]
    assert [key for key, _ in validate_config({}).worker_pools()] == ["decode", "prefill"]
    with pytest.raises(ConfigError, match="either colocated or prefill/decode"):
        validate_config({"pools": {"colocated": {"replicas": 2}, "prefill": {"replicas": 1}}})
