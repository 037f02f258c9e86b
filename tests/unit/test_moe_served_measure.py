"""benchmarks/engine/moe.py's client-side measure and sizing, and moe_decode.py's token
agreement, on made-up numbers (the served run itself is benchmarks/engine/moe.py's)."""

from __future__ import annotations

import pytest

from benchmarks.chaos_harness import decode_rate
from benchmarks.engine.moe import MOE_SHAPE, agreement, kv_bytes, served_yaml
from pdserve.deploy.config.load import validate_config


def test_decode_rate_counts_the_tokens_after_every_request_has_its_first():
    a = [(1.0, [5]), (2.0, [6]), (3.0, [7]), (4.0, [8])]
    b = [(2.5, [9]), (3.5, [10, 11]), (5.0, [12])]  # its first token at 2.5: t_all
    rate = decode_rate([a, b], t_start=0.5)
    assert rate["t_all_first_token_s"] == 2.0
    assert rate["t_total_s"] == 4.5
    assert rate["decode_tokens"] == 5  # a: 7, 8; b: 10, 11, 12
    assert rate["decode_time_s"] == 2.5
    assert rate["decode_tok_s"] == pytest.approx(2.0)
    assert rate["ttft_s"] == [0.5, 2.0]


def test_kv_bytes_of_the_benchmark_shape_and_the_yaml_keys():
    # 8 layers x (K, V) x 4 KV heads x 64 x 4 bytes = 16 KiB a token
    assert kv_bytes(MOE_SHAPE, 1) == 16384
    config = served_yaml(kv_bytes(MOE_SHAPE, 4608), 1, "/tmp/x")
    for pool in ("prefill", "decode"):
        assert config["pools"][pool] == {
            "resources": {"num_cpus": 1},
            "num_threads": 1,
            "kv_cache_memory": 72 << 20,
        }
    assert config["ray"] == {"num_cpus": 2, "temp_dir": "/tmp/x"}
    assert "model" not in config  # the model goes by --model
    deployment = validate_config(config)  # keys the schema knows, values it takes
    assert deployment.pools.decode.threads == 1


def test_agreement_gives_the_first_mismatch_of_each_differing_sequence():
    got = agreement([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [[1, 2, 3], [4, 0, 6], [0, 8, 9]])
    assert got == {"identical": 1, "of": 3, "first_mismatch": {1: 1, 2: 0}}
