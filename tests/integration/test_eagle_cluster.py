"""An EAGLE-3 head through a prefill worker and a decode worker (engine/spec/eagle.py): the prefill
worker runs the head over each prompt and sends the head's KV on as "draft" chunks (over grpc;
over shm on its control channel, beside the KV written in place), so the decode worker's guesses
are those of a head that saw the whole prompt (recomputed with plain torch,
tests/helpers/eagle.py), its tokens the target's, every byte counted. Over nixl, which carries no
payload frames, the decode side clears the head's blocks of the prompt instead. A DeepSeek V3
target's own MTP layer goes the same way (over shm)."""

from __future__ import annotations

import pytest

from helpers.eagle import check_guesses, make_head, recording
from helpers.models import make_tiny_model, random_prompts
from helpers.mtp import make_mtp_target
from helpers.threads import wait_until
from helpers.worker import BackendCluster, idle
from pdserve.deploy.config.schema import nixl_installed
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.spec import eagle as spec_eagle
from pdserve.protos.pdserve.v1 import pdserve_pb2

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 20
SAMPLING = pdserve_pb2.SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = tmp_path_factory.mktemp("eagle-cluster")
    hf = make_tiny_model(target, "llama-gqa", num_hidden_layers=6)
    head = tmp_path_factory.mktemp("eagle-cluster-head")
    tensors = make_head(head, hf, "eagle3")
    prompts = random_prompts([5, 17, 30, 41], seed=4)
    llm = LLM(str(target), dtype="float32", kv_cache_memory=1 << 20, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    return str(target), hf, tensors, spec, prompts, want


@pytest.mark.parametrize(
    "backend",
    [
        "grpc",
        "shm",
        pytest.param("nixl", marks=pytest.mark.skipif(not nixl_installed(), reason="no NIXL")),
    ],
)
def test_the_heads_prompt_kv_travels_with_the_hand_off(
    setup, always_speculate, monkeypatch, backend
):
    _serve(setup, monkeypatch, backend)


@pytest.mark.parametrize("tps", [(2, 1), (1, 2)], ids=["prefill-tp2", "decode-tp2"])
def test_the_heads_prompt_kv_travels_from_and_to_tensor_parallel_workers(
    setup, always_speculate, monkeypatch, tps
):
    """A worker at TP=2 runs the head on its first rank: the prefill worker's sink sends the
    head's KV from there, the decode worker's receiver writes it there. (One engine of TP > 1
    a process: the default process group is its.)"""
    _serve(setup, monkeypatch, "grpc", *tps)


@pytest.fixture(scope="module")
def mtp_setup(tmp_path_factory):
    """A DeepSeek V3 target whose checkpoint carries an MTP layer (latent attention: its KV one
    latent a token, as the target's)."""
    target = tmp_path_factory.mktemp("mtp-cluster")
    hf, tensors = make_mtp_target(target, "deepseek-v3")
    prompts = random_prompts([5, 30], seed=4)
    llm = LLM(str(target), dtype="float32", kv_cache_memory=1 << 20, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    return str(target), hf, tensors, spec, prompts, want


def test_an_mtp_layers_prompt_kv_travels_with_the_hand_off(
    mtp_setup, always_speculate, monkeypatch
):
    _serve(mtp_setup, monkeypatch, "shm")


def _serve(setup, monkeypatch, backend: str, prefill_tp: int = 1, decode_tp: int = 1) -> None:
    """The prompts through one prefill and one decode worker on `backend` (the first two where
    a worker runs at TP=2, whose steps cost more on two cores): tokens the target's, bytes
    counted on both sides, every guess the head's (check_guesses)."""
    model_dir, hf, tensors, spec, prompts, want = setup
    if max(prefill_tp, decode_tp) > 1:
        prompts = prompts[:2]
    monkeypatch.setattr(spec_eagle, "CONTINUE_AT", 0.0)  # (every guess step runs)
    cluster = BackendCluster(
        model_dir, backend, prefill_tp, decode_tp, dtype="float32", speculative_config=spec
    )
    records = recording(monkeypatch)  # (after the workers' warm-up requests, which run locally)
    try:
        sent = 0
        for i, p in enumerate(prompts):
            reservation = cluster.reserve(f"e-{i}", p, SAMPLING)
            first = cluster.prefill_req(f"e-{i}", p, reservation, SAMPLING)
            sent += first.bytes_sent
            events = cluster.stream(f"e-{i}")
            assert [t for e in events for t in e.token_ids] == want[i]
        stats = cluster.stats()
        assert stats.kv_transfer_bytes == sent  # the head's chunks counted on both sides
        assert stats.spec_drafts > 0
        wait_until(lambda: idle(cluster), 5, f"decode pool not idle: {cluster.stats()}")
    finally:
        cluster.stop()
    check_guesses(records, hf, spec["method"], tensors, zeroed=backend == "nixl")
