"""`pdserve up --model HuggingFaceTB/SmolLM2-135M-Instruct`, run as a command with HF_HUB_OFFLINE=1
and HF_HOME pointing to a hub cache the test builds (tests/hub_helpers.py) from the converted
embedded SmolLM2, serves the same greedy tokens as the engine on `smollm2`, under the Hub id as its
model id; the flags go over a YAML of small settings (its `model: smollm2` loses to --model), and
the key given by --api-key is the one the router asks for. Nothing is downloaded."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading

import grpc
import pytest
import yaml

from hub_helpers import add_to_hub_cache
from smollm2_prompts import PROMPTS

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).parents[2]
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
KEY = "sk-e2e-hub-0123456789"
MAX_TOKENS = 8
KV_BYTES = 64 << 20
START_TIMEOUT_S = 300.0


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


def _router_address(proc: subprocess.Popen, timeout_s: float) -> str:
    """Reads `proc`'s stdout on a thread of its own until `ready`; the router's address it printed."""
    seen, address = threading.Event(), []

    def read():
        for line in proc.stdout:
            found = re.fullmatch(r"router on (\S+)", line.strip())
            if found:
                address.append(found[1])
            if line.strip() == "ready":
                seen.set()
                return

    threading.Thread(target=read, daemon=True).start()
    if not seen.wait(timeout_s):
        state = f"exited {proc.poll()}" if proc.poll() is not None else "still starting"
        raise AssertionError(f"`pdserve up` printed no 'ready' within {timeout_s:.0f}s ({state})")
    return address[0]


def test_up_serves_a_hub_id_from_the_cache_as_smollm2(reference, tmp_path):
    from pdserve.engine.loader import resolve_model
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    add_to_hub_cache(tmp_path / "hf" / "hub", REPO, resolve_model("smollm2"))
    ray_tmp = tempfile.mkdtemp(prefix="pdray")  # short: Ray's socket paths live under it
    pool = {"replicas": 1, "resources": {"num_cpus": 1}, "num_threads": 1,
            "kv_cache_memory": KV_BYTES}  # fmt: skip
    config = tmp_path / "small.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": "smollm2",
                "pools": {"prefill": pool, "decode": pool},
                "ray": {"num_cpus": 2, "temp_dir": ray_tmp},
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PDSERVE_API_KEY"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    err_path = tmp_path / "up.err"
    with open(err_path, "w") as err:
        up = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "up", str(config), "--model", REPO, "--port", "0",
             "--http-port", "off", "--max-model-len", "1024", "--dtype", "float32",
             "--api-key", KEY],
            stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, env=env,
        )  # fmt: skip
    try:
        address = _router_address(up, START_TIMEOUT_S)
        metadata = (("authorization", f"Bearer {KEY}"),)
        prompts, want = reference
        with grpc.insecure_channel(address) as channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            cards = stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=30).models
            assert [c.id for c in cards] == [REPO]
            with pytest.raises(grpc.RpcError) as refused:  # --api-key: the router has a key
                stub.ListModels(pb.ListModelsRequest(), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            got = []
            for ids in prompts:
                request = pb.GenerateRequest(
                    model=REPO,
                    token_ids=pb.TokenIds(ids=ids),
                    sampling=pb.SamplingParams(
                        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True
                    ),
                )
                tokens = []
                for resp in stub.Generate(request, metadata=metadata, timeout=120):
                    if resp.HasField("delta"):
                        tokens += list(resp.delta.token_ids)
                got.append(tokens)
        assert got == want
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)  # `up` stops its deployment and its local Ray
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        if up.returncode not in (0, None):
            print(err_path.read_text()[-4000:])
