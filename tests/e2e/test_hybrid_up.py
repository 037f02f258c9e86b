"""A random-weight hybrid model (tests/helpers/arch.py's tiny Qwen3.5: three Gated DeltaNet layers
and one gated full-attention layer) served by `pdserve up --model DIR` with one prefill and one
decode worker: each prompt's full-attention KV and linear layers' recurrent state go from the
prefill worker to the decode worker, and 4 prompts of mixed lengths, sent at once over gRPC, get
the same 16 greedy tokens as the engine alone on DIR (tests/helpers/up.py serves_as_the_engine)."""

from __future__ import annotations

import pytest

from helpers.up import serves_as_the_engine

pytestmark = pytest.mark.slow


def test_up_serves_a_random_hybrid_as_the_engine_does(tmp_path):
    # half of the 4 MiB for the states (17 KB a sequence), half for the one full layer's KV
    serves_as_the_engine(tmp_path, "qwen3.5", 4 << 20)
