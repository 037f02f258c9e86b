"""A Qwen3.5 model (tests/helpers/arch.py "qwen3.5": Gated DeltaNet layers with per-sequence
recurrent state beside gated full attention) through a prefill worker and a decode worker: the
full-attention layers' KV and each linear layer's state ("state" frames): in turn,
Reserve -> Prefill -> Stream giving HF transformers' greedy tokens one at a time and
concurrently, every byte counted, and the decode pool free at the end, over grpc and shm. On
"auto" the decode worker offers only the backends that carry the state; nixl, which only writes
in place, is refused at its start."""

from __future__ import annotations

import grpc
import pytest
import torch

from helpers.arch import arch_prompts, build_arch_model
from helpers.threads import wait_until
from helpers.worker import (
    GREEDY,
    MAX_MODEL_LEN,
    BackendCluster,
    generate_concurrently,
    idle,
    used_backends,
)
from pdserve.deploy.config.schema import nixl_installed
from pdserve.kvtransfer.choose import STATE_BACKENDS
from pdserve.protos.pdserve.v1 import pdserve_pb2

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid-cluster")
    hf = build_arch_model(path, "qwen3.5", initializer_range=0.1)
    room = MAX_MODEL_LEN - GREEDY.max_tokens
    prompts = [p[:room] for p in arch_prompts()[1:5]]
    want = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
            want.append(out[0, len(p) :].tolist())
    return str(path), hf.config, prompts, want


def hand_off_bytes(config, tokens: int) -> int:
    """What one prompt's hand-off moves, float32: K and V of its tokens in each full-attention
    layer, and each linear layer's state (the conv window and the delta-rule matrices)."""
    full = config.layer_types.count("full_attention")
    linear = config.layer_types.count("linear_attention")
    kv = tokens * full * 2 * config.num_key_value_heads * config.head_dim
    channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim
    channels += config.linear_num_value_heads * config.linear_value_head_dim
    conv = (config.linear_conv_kernel_dim - 1) * channels
    ssm = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    return 4 * (kv + linear * (conv + ssm))


@pytest.mark.parametrize("backend", ["grpc", "shm"])
def test_hybrid_hand_off(reference, backend):
    """(shm: the KV written in place into the decode pool, the state on its control channel)"""
    model_dir, config, prompts, want = reference
    cluster = BackendCluster(model_dir, backend, 1, 1)
    try:
        for i, p in enumerate(prompts):
            reservation = cluster.reserve(f"one-{i}", p)
            first = cluster.prefill_req(f"one-{i}", p, reservation)
            assert first.bytes_sent == hand_off_bytes(config, len(p))
            events = cluster.stream(f"one-{i}")
            assert [t for e in events for t in e.token_ids] == want[i]
        # the decode worker counts what it received, state frames too
        sent = sum(hand_off_bytes(config, len(p)) for p in prompts)
        assert cluster.stats().kv_transfer_bytes == sent
        # the pool's budget holds three states (half of its 128 KiB): three at once
        assert generate_concurrently(cluster, prompts[:3]) == want[:3]
        wait_until(lambda: idle(cluster), 5, f"decode pool not idle: {cluster.stats()}")
        held = [cluster.reserve(f"hold-{i}", p) for i, p in enumerate(prompts[:3])]
        with pytest.raises(grpc.RpcError) as refused:
            cluster.reserve("fourth", prompts[3])
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "recurrent-state slots" in refused.value.details()
        for i in range(len(held)):
            cluster.d.Abort(pdserve_pb2.AbortRequest(request_id=f"hold-{i}"))
        wait_until(lambda: idle(cluster), 5, f"decode pool not idle: {cluster.stats()}")
    finally:
        cluster.stop()


@pytest.mark.skipif(not nixl_installed(), reason="no NIXL")
def test_in_place_backend_refused_for_a_hybrid(reference):
    """nixl writes KV straight into the decode pool, which holds no state: refused at start."""
    model_dir, *_ = reference
    with pytest.raises(Exception, match="does not carry yet"):
        BackendCluster(model_dir, "nixl", 1, 1).stop()


def test_auto_offers_only_what_carries_the_state(reference):
    """On "auto" (shm first on one host for other models) a hybrid's decode worker offers
    only the backends that carry its state, and the hand-off takes one of them."""
    model_dir, config, prompts, want = reference
    cluster = BackendCluster(model_dir, "auto", 1, 1)
    try:
        assert cluster.generate("auto-0", prompts[2]) == want[2]
        assert used_backends(cluster) <= set(STATE_BACKENDS)
    finally:
        cluster.stop()


@pytest.mark.parametrize("backend", ["grpc", "auto"])
def test_a_model_without_kv_hands_off_its_state_alone(tmp_path, backend):
    """Mamba2 alone (no layer attends: the reservation's blocks only count positions): the
    hand-off carries the state frames and nothing else, and HF's tokens come out; on "auto"
    over a backend that carries state (shm, which writes KV in place, is refused by name)."""
    hf = build_arch_model(tmp_path, "mamba2", initializer_range=0.1)
    prompts = [p[: MAX_MODEL_LEN - GREEDY.max_tokens] for p in arch_prompts()[2:4]]
    with pytest.raises(Exception, match="keeps no KV: the shm backend"):
        BackendCluster(str(tmp_path), "shm", 1, 1).stop()
    cluster = BackendCluster(str(tmp_path), backend, 1, 1)
    try:
        for i, p in enumerate(prompts):
            with torch.inference_mode():
                out = hf.generate(
                    torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False
                )
            assert cluster.generate(f"m-{i}", p) == out[0, len(p) :].tolist()
        if backend == "auto":
            assert used_backends(cluster) <= set(STATE_BACKENDS) - {"shm"}
        wait_until(lambda: idle(cluster), 5, f"decode pool not idle: {cluster.stats()}")
    finally:
        cluster.stop()


def test_the_decode_worker_guesses_after_a_hybrids_hand_off(
    reference, always_speculate, bad_guesses
):
    """Prompt lookup on the decode worker (guesses mostly wrong): each rejection takes the
    state copied before the step back (engine/scheduler.py plan_rollbacks), over a state that
    arrived by hand-off; HF's tokens, and the decode pool free at the end."""
    model_dir, _, prompts, want = reference
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    cluster = BackendCluster(model_dir, "grpc", 1, 1, speculative_config=spec)
    try:
        for i, p in enumerate(prompts):
            reservation = cluster.reserve(f"g-{i}", p)
            cluster.prefill_req(f"g-{i}", p, reservation)
            events = cluster.stream(f"g-{i}")
            assert [t for e in events for t in e.token_ids] == want[i]
        stats = cluster.stats()
        assert stats.spec_draft_tokens > stats.spec_accepted_tokens, stats
        wait_until(lambda: idle(cluster), 5, f"decode pool not idle: {cluster.stats()}")
    finally:
        cluster.stop()
