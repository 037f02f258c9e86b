"""`pdserve up --model <a Hub id>`, run as a command with HF_HUB_OFFLINE=1 and HF_HOME pointing to
a hub cache the test builds (tests/helpers/hub.py) from a tiny random model, serves the same greedy
tokens as the engine on that model's directory, under the Hub id as its model id; the flags go over
a YAML of small settings (its `model: smollm2` loses to --model), and the key given by --api-key is
the one the router asks for. Nothing is downloaded. (A tiny model: what is tested is the Hub
cache's layout and the flags, and the embedded SmolLM2's workers cost ~25 s more of CI.)"""

from __future__ import annotations

import os

import grpc
import pytest

from helpers.hub import add_to_hub_cache
from helpers.models import random_prompts
from helpers.up import greedy_tokens, pdserve_up, ray_temp_dir, small_pools_yaml

pytestmark = pytest.mark.slow

REPO = "pdserve-tests/tiny-llama"
KEY = "sk-e2e-hub-0123456789"
MAX_TOKENS = 8
KV_BYTES = 4 << 20


@pytest.fixture(scope="module")
def reference(tiny_models):
    """The tiny model's directory, two prompts' ids and the engine's greedy tokens on it in this
    process (float32, as the deployment's workers)."""
    from pdserve.engine import LLM, SamplingParams

    model_dir = tiny_models("llama-gqa")[0]
    llm = LLM(model_dir, dtype="float32", kv_cache_memory=KV_BYTES, max_model_len=512)
    prompts = random_prompts([9, 31], seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    llm.shutdown()
    return model_dir, prompts, [list(o.outputs[0].token_ids) for o in outs]


def test_up_serves_a_hub_id_from_the_cache_as_the_engine_does(reference, tmp_path):
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    model_dir, prompts, want = reference
    add_to_hub_cache(tmp_path / "hf" / "hub", REPO, model_dir)
    with ray_temp_dir() as ray_tmp:
        config = small_pools_yaml(tmp_path / "small.yaml", KV_BYTES, ray_tmp, model="smollm2")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PDSERVE_API_KEY"))}
        env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
        args = [str(config), "--model", REPO, "--port", "0", "--http-port", "off",
                "--max-model-len", "512", "--dtype", "float32", "--api-key", KEY]  # fmt: skip
        with pdserve_up(args, tmp_path / "up.err", env) as address:
            metadata = (("authorization", f"Bearer {KEY}"),)
            with grpc.insecure_channel(address) as channel:
                stub = pdserve_pb2_grpc.PDServeStub(channel)
                cards = stub.ListModels(
                    pb.ListModelsRequest(), metadata=metadata, timeout=30
                ).models
                assert [c.id for c in cards] == [REPO]
                with pytest.raises(grpc.RpcError) as refused:  # --api-key: the router has a key
                    stub.ListModels(pb.ListModelsRequest(), timeout=30)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                got = [greedy_tokens(stub, pb, ids, MAX_TOKENS, REPO, metadata) for ids in prompts]
            assert got == want
