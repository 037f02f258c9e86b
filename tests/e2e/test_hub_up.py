"""`pdserve up --model HuggingFaceTB/SmolLM2-135M-Instruct`, run as a command with HF_HUB_OFFLINE=1
and HF_HOME pointing to a hub cache the test builds (tests/helpers/hub.py) from the converted
embedded SmolLM2, serves the same greedy tokens as the engine on `smollm2`, under the Hub id as its
model id; the flags go over a YAML of small settings (its `model: smollm2` loses to --model), and
the key given by --api-key is the one the router asks for. Nothing is downloaded."""

from __future__ import annotations

import os

import grpc
import pytest

from helpers.hub import add_to_hub_cache
from helpers.smollm2_prompts import PROMPTS
from helpers.up import greedy_tokens, pdserve_up, small_pools_yaml

pytestmark = pytest.mark.slow

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
KEY = "sk-e2e-hub-0123456789"
MAX_TOKENS = 8
KV_BYTES = 64 << 20


@pytest.fixture(scope="module")
def reference():
    """Two prompts' ids and the engine's greedy tokens on `smollm2` in this process (float32, as
    the deployment's workers)."""
    from pdserve.engine import LLM, SamplingParams

    llm = LLM("smollm2", dtype="float32", kv_cache_memory=KV_BYTES, max_model_len=1024)
    prompts = [llm.get_tokenizer().encode(p) for p in PROMPTS[:2]]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    llm.shutdown()
    return prompts, [list(o.outputs[0].token_ids) for o in outs]


def test_up_serves_a_hub_id_from_the_cache_as_smollm2(reference, tmp_path):
    from pdserve.engine.loader import resolve_model
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    add_to_hub_cache(tmp_path / "hf" / "hub", REPO, resolve_model("smollm2"))
    config = small_pools_yaml(tmp_path / "small.yaml", KV_BYTES, model="smollm2")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PDSERVE_API_KEY"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    args = [str(config), "--model", REPO, "--port", "0", "--http-port", "off",
            "--max-model-len", "1024", "--dtype", "float32", "--api-key", KEY]  # fmt: skip
    with pdserve_up(args, tmp_path / "up.err", env) as address:
        metadata = (("authorization", f"Bearer {KEY}"),)
        prompts, want = reference
        with grpc.insecure_channel(address) as channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            cards = stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=30).models
            assert [c.id for c in cards] == [REPO]
            with pytest.raises(grpc.RpcError) as refused:  # --api-key: the router has a key
                stub.ListModels(pb.ListModelsRequest(), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            got = [greedy_tokens(stub, pb, ids, MAX_TOKENS, REPO, metadata) for ids in prompts]
        assert got == want
