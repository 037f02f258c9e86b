"""A prefill pool in pipeline stages through `pdserve up` (issue #53, must-show a's cluster half):
a random 5-layer tiny Llama, its prefill worker TP 2 x PP 2 (four rank processes), its decode
worker TP 2 (each prefill stage's ranks push their heads of their layers into both decode ranks);
prompts of mixed lengths sent at once get the engine's greedy tokens in one process. The hand-off
itself, per backend and stage layout, into a decode worker of one rank:
tests/integration/test_pp_handoff.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import yaml

from helpers.models import make_tiny_model, random_prompts
from helpers.up import greedy_tokens, pdserve_up, ray_temp_dir

pytestmark = pytest.mark.slow

LENGTHS = (3, 17, 40, 90)
MAX_TOKENS = 12
KV_BYTES = 4 << 20
MAX_MODEL_LEN = 256


def test_up_serves_a_tp2_pp2_prefill_pool_into_tp2_decode_as_the_engine_does(tmp_path):
    from pdserve.engine import LLM, SamplingParams
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    model_dir = str(tmp_path / "tiny5")
    make_tiny_model(model_dir, "llama-gqa", seed=5, num_hidden_layers=5)
    prompts = random_prompts(LENGTHS, seed=53)
    llm = LLM(model_dir, dtype="float32", kv_cache_memory=KV_BYTES, max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    llm.shutdown()

    small = {"num_threads": 1, "kv_cache_memory": KV_BYTES}
    with ray_temp_dir() as ray_tmp:
        config = tmp_path / "pp.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "pools": {
                        # four ranks' bundles on one CPU between them, two on the other
                        "prefill": {**small, "tp": 2, "resources": {"num_cpus": 0.25}},
                        "decode": {**small, "tp": 2, "resources": {"num_cpus": 0.5}},
                    },
                    "ray": {"num_cpus": 2, "temp_dir": ray_tmp},
                }
            )
        )
        args = [str(config), "--model", model_dir, "--prefill-pp", "2", "--port", "0",
                "--http-port", "off", "--max-model-len", str(MAX_MODEL_LEN),
                "--dtype", "float32"]  # fmt: skip
        err = tmp_path / "up.err"
        with pdserve_up(args, err) as address:
            with grpc.insecure_channel(address) as channel:
                stub = pdserve_pb2_grpc.PDServeStub(channel)
                with ThreadPoolExecutor(len(prompts)) as pool:
                    got = list(
                        pool.map(lambda ids: greedy_tokens(stub, pb, ids, MAX_TOKENS), prompts)
                    )
    assert got == want
