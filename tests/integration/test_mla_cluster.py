"""A DeepSeek V3 model (multi-head latent attention, tests/helpers/arch.py "deepseek-v3") through a
prefill worker and a decode worker, over the grpc and shm KV backends and TP mixes: Reserve -> Prefill ->
Stream gives HF transformers' greedy tokens, one at a time and concurrently, each hand-off ships
exactly the latent (kv_lora_rank + qk_rope_head_dim values a token a layer, float32) whatever the
two sides' TP sizes, and the decode pool ends free."""

from __future__ import annotations

import pytest
import torch

from helpers.arch import arch_prompts, build_arch_model
from helpers.threads import wait_until
from helpers.worker import (
    GREEDY,
    MAX_MODEL_LEN,
    BackendCluster,
    Cluster,
    generate_concurrently,
    idle,
    start_decode,
)
from pdserve.deploy.config.schema import nixl_installed

pytestmark = pytest.mark.usefixtures("one_thread")
LATENT = 32 + 16  # the kind's kv_lora_rank + qk_rope_head_dim


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("mla-cluster")
    hf = build_arch_model(path, "deepseek-v3", initializer_range=0.1)
    room = MAX_MODEL_LEN - GREEDY.max_tokens
    prompts = [p[:room] for p in arch_prompts()[1:5]]  # 7, 33, 56 and 56 tokens
    want = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
            want.append(out[0, len(p) :].tolist())
    return str(path), hf.config.num_hidden_layers, prompts, want


def hand_off_each(cluster, layers: int, prompts, want) -> None:
    """Reserve -> Prefill -> Stream of each prompt in turn: one latent a token a layer sent
    (float32), HF's tokens streamed."""
    for i, p in enumerate(prompts):
        reservation = cluster.reserve(f"one-{i}", p)
        first = cluster.prefill_req(f"one-{i}", p, reservation)
        assert first.bytes_sent == len(p) * layers * LATENT * 4
        events = cluster.stream(f"one-{i}")
        assert [t for e in events for t in e.token_ids] == want[i]


@pytest.mark.parametrize(
    "backend,prefill_tp,decode_tp",
    [
        ("shm", 2, 1),
        ("shm", 1, 2),
        ("grpc", 1, 2),
        pytest.param(
            "nixl", 1, 2, marks=pytest.mark.skipif(not nixl_installed(), reason="no NIXL")
        ),
    ],
)
def test_mla_hand_off_ships_the_latent(reference, backend, prefill_tp, decode_tp):
    """Under TP every rank holds the whole latent: it leaves one prefill rank once, and lands
    in every decode rank."""
    model_dir, layers, prompts, want = reference
    cluster = BackendCluster(model_dir, backend, prefill_tp, decode_tp)
    try:
        hand_off_each(cluster, layers, prompts, want)
        assert generate_concurrently(cluster, prompts) == want
        wait_until(lambda: idle(cluster), 5, f"decode pool not idle: {cluster.stats()}")
    finally:
        cluster.stop()


def test_a_pipelined_tp2_prefill_sends_the_latent_once(reference):
    """A prefill worker of 2 stages x 2 ranks (shm): each stage's latents leave its first rank
    only (the other reports REPLICA), and the tokens are HF's."""
    model_dir, layers, prompts, want = reference
    cluster = Cluster.__new__(Cluster)
    engine = dict(kv_cache_memory=1 << 17, max_model_len=MAX_MODEL_LEN)
    cluster.decode = start_decode(model_dir, engine=engine, lease_ms=10_000, kv_backend="shm")
    cluster.add_prefill(
        model_dir, engine=dict(tensor_parallel_size=2, pipeline_parallel_size=2, **engine)
    )
    try:
        hand_off_each(cluster, layers, prompts, want)
        wait_until(lambda: idle(cluster), 5, f"decode pool not idle: {cluster.stats()}")
    finally:
        cluster.stop()
