"""A random-weight hybrid model (tests/helpers/arch.py's tiny Qwen3.5: three Gated DeltaNet layers
and one gated full-attention layer) served by `pdserve up --model DIR` with one prefill and one
decode worker: each prompt's full-attention KV and linear layers' recurrent state go from the
prefill worker to the decode worker, and 4 prompts of mixed lengths, sent at once over gRPC, get
the same 16 greedy tokens as the engine alone on DIR (`LLM(DIR, dtype="float32")` here)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from helpers.arch import build_arch_model
from helpers.models import random_prompts
from helpers.up import greedy_tokens, pdserve_up, small_pools_yaml

pytestmark = pytest.mark.slow

LENGTHS = (3, 17, 40, 90)
MAX_TOKENS = 16
KV_BYTES = 4 << 20  # half for the states (17 KB a sequence), half for the KV of one layer
MAX_MODEL_LEN = 256


def test_up_serves_a_random_hybrid_as_the_engine_does(tmp_path):
    from pdserve.engine import LLM, SamplingParams
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    model_dir = tmp_path / "qwen3.5"
    build_arch_model(model_dir, "qwen3.5", initializer_range=0.1)
    prompts = random_prompts(LENGTHS, seed=29)
    llm = LLM(
        str(model_dir), dtype="float32", kv_cache_memory=KV_BYTES, max_model_len=MAX_MODEL_LEN
    )
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    llm.shutdown()
    assert len({tuple(w) for w in want}) == len(want)  # distinct continuations: a real check

    config = small_pools_yaml(tmp_path / "small.yaml", KV_BYTES)
    args = [str(config), "--model", str(model_dir), "--prefill-replicas", "1",
            "--decode-replicas", "1", "--port", "0", "--http-port", "off",
            "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32"]  # fmt: skip
    with pdserve_up(args, tmp_path / "up.err") as address:
        with grpc.insecure_channel(address) as channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            with ThreadPoolExecutor(len(prompts)) as pool:  # at once: one batch of mixed lengths
                got = list(pool.map(lambda ids: greedy_tokens(stub, pb, ids, MAX_TOKENS), prompts))
    assert got == want
