"""A random-weight mixture-of-experts model (tests/helpers/arch.py's tiny Mixtral: 4 experts, top-2)
served by `pdserve up --model DIR` with one prefill and one decode worker: 4 prompts of mixed
lengths, sent at once over gRPC, get the same 16 greedy tokens as the engine alone on DIR
(`LLM(DIR, dtype="float32")` in this process). The model goes by the flag: the YAML holds only the
small pools and the local Ray (issue #29, must-show b's e2e half; benchmarks/engine/moe.py measures
it)."""

from __future__ import annotations

import pytest

from helpers.up import serves_as_the_engine

pytestmark = pytest.mark.slow


def test_up_serves_a_random_moe_as_the_engine_does(tmp_path):
    serves_as_the_engine(tmp_path, "mixtral", 4 << 20)  # (8192 tokens of the tiny model's KV)
