"""LoRA adapters through `pdserve up` (issue 52, must-show a's deployment half): a tiny random
Llama and two random PEFT adapters, served with vLLM's flags (`--enable-lora --lora-modules
sql=DIR poem=DIR --max-lora-rank 8`) by one prefill and one decode worker; prompts under each
adapter and under the base, sent at once over gRPC, get HF + PEFT's greedy tokens, and ListModels
lists the adapters with the base as their parent. The in-process cluster's checks (the prefix
cache across adapters, run-time load and unload, refusals) are in
tests/integration/test_lora_cluster.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from helpers.lora import ADAPTERS, LORA_NEW, lora_family, lora_prompts, lora_refs
from helpers.up import greedy_tokens, pdserve_up, ray_temp_dir, small_pools_yaml

pytestmark = pytest.mark.slow

KV_BYTES = 4 << 20
MAX_MODEL_LEN = 256


def test_up_serves_adapters_and_base_as_hf_peft(tmp_path):
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    base, dirs, models = lora_family(tmp_path / "family", "llama")
    prompts = lora_prompts()
    want = lora_refs(models, prompts)
    with ray_temp_dir() as ray_tmp:
        config = small_pools_yaml(tmp_path / "small.yaml", KV_BYTES, ray_tmp)
        modules = [f"{name}={path}" for name, path in dirs.items()]
        args = [str(config), "--model", base, "--prefill-replicas", "1", "--decode-replicas", "1",
                "--port", "0", "--http-port", "off", "--max-model-len", str(MAX_MODEL_LEN),
                "--dtype", "float32", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                "--lora-modules", *modules]  # fmt: skip
        jobs = [(k, i) for k in ("base", *ADAPTERS) for i in range(len(prompts))]
        with pdserve_up(args, tmp_path / "up.err") as address:
            with grpc.insecure_channel(address) as channel:
                stub = pdserve_pb2_grpc.PDServeStub(channel)

                def run(job):
                    k, i = job
                    model = "" if k == "base" else k
                    return greedy_tokens(stub, pb, prompts[i], LORA_NEW, model=model)

                with ThreadPoolExecutor(len(jobs)) as pool:  # at once: adapters and base mixed
                    got = dict(zip(jobs, pool.map(run, jobs)))
                models_listed = stub.ListModels(pb.ListModelsRequest(), timeout=30).models
    for k, i in jobs:
        assert got[(k, i)] == want[k][i], (k, i)
    cards = {m.id: m.parent for m in models_listed}
    base_id = next(m for m, parent in cards.items() if not parent)
    assert {m for m, parent in cards.items() if parent == base_id} == set(ADAPTERS)
