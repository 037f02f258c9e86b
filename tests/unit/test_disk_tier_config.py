"""The disk tier's YAML keys (deploy/config/schema.py: pools.*.kv_disk_tier_bytes and
kv_disk_tier_dir): defaults, what they pass to the engine, and the errors for what cannot work."""

from __future__ import annotations

import pytest

from pdserve.deploy.config.load import ConfigError, validate_config


def test_off_by_default():
    cfg = validate_config({})
    for pool in (cfg.pools.prefill, cfg.pools.decode):
        assert pool.kv_disk_tier_bytes == 0 and pool.kv_disk_tier_dir is None
        assert "kv_disk_tier_bytes" not in cfg.engine_kwargs(pool)


def test_the_keys_reach_the_engine():
    cfg = validate_config(
        {
            "pools": {
                "decode": {
                    "kv_host_tier_bytes": 1 << 26,
                    "kv_disk_tier_bytes": 1 << 30,
                    "kv_disk_tier_dir": "/var/tmp/kv",
                }
            }
        }
    )
    kwargs = cfg.engine_kwargs(cfg.pools.decode)
    assert kwargs["kv_disk_tier_bytes"] == 1 << 30
    assert kwargs["kv_disk_tier_dir"] == "/var/tmp/kv"
    assert "kv_disk_tier_bytes" not in cfg.engine_kwargs(cfg.pools.prefill)


@pytest.mark.parametrize(
    "decode, says",
    [
        ({"kv_disk_tier_bytes": 1 << 20}, "needs kv_host_tier_bytes"),
        ({"kv_host_tier_bytes": 1, "kv_disk_tier_bytes": -1}, "kv_disk_tier_bytes"),
        ({"kv_host_tier_bytes": 1, "kv_disk_tier_bytes": "1G"}, "kv_disk_tier_bytes"),
        ({"kv_disk_tier_dir": "/tmp/x"}, "kv_disk_tier_bytes is 0"),
        ({"kv_host_tier_bytes": 1, "kv_disk_tier_bytes": 1, "kv_disk_tier_dir": ""}, "dir"),
    ],
)
def test_bad_values_are_refused_by_name(decode, says):
    with pytest.raises(ConfigError, match=says):
        validate_config({"pools": {"decode": decode}})
