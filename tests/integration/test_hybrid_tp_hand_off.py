"""A hybrid model's P/D hand-off from and to tensor-parallel workers: each rank holds its heads'
part of every recurrent state (engine/recurrent_state.py StateLayout), so the prefill worker's
first rank joins the ranks' parts into the whole state (read from their files) and the decode
worker's first rank cuts it for its ranks. Each recurrent kind cuts differently: Gated DeltaNet
(Qwen3.5) its q, k and v channels and value heads, Mamba2 (Granite 4.0-H) its heads' channels
while every rank holds the single group of B and C, LFM2 its convolution's channels, Mamba
(Jamba) its inner channels; Mamba2 alone (no attention layer, so no KV pool) splits its groups
too. Over grpc, and over shm (the KV written in place into each decode rank's pool, the state
on its control channel). Every greedy token is HF transformers', and the decode worker receives
every byte the prefill worker sent (the whole state, as at one rank)."""

from __future__ import annotations

import pytest
import torch

from helpers.arch import arch_prompts, build_arch_model
from helpers.threads import wait_until
from helpers.worker import GREEDY, MAX_MODEL_LEN, BackendCluster, idle

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [  # (kind, prefill TP, decode TP, backend): each kind's state joined or cut
    ("qwen3.5", 2, 1, "grpc"),
    ("qwen3.5", 1, 2, "shm"),
    ("granite-4.0-h", 2, 1, "shm"),
    ("granite-4.0-h", 1, 2, "grpc"),
    ("lfm2", 2, 1, "grpc"),
    ("jamba", 1, 2, "grpc"),
    ("mamba2", 2, 1, "grpc"),
]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """kind -> (model_dir, prompts, HF's greedy tokens), built when first asked for."""
    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            path = tmp_path_factory.mktemp(f"hybrid-tp-{kind}")
            hf = build_arch_model(path, kind, initializer_range=0.1)
            room = MAX_MODEL_LEN - GREEDY.max_tokens
            prompts = [p[:room] for p in arch_prompts()[1:3]]
            want = []
            with torch.inference_mode():
                for p in prompts:
                    out = hf.generate(
                        torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False
                    )
                    want.append(out[0, len(p) :].tolist())
            cache[kind] = (str(path), prompts, want)
        return cache[kind]

    return get


@pytest.mark.parametrize(
    ("kind", "prefill_tp", "decode_tp", "backend"),
    CASES,
    ids=[f"{k}-p{p}d{d}-{b}" for k, p, d, b in CASES],
)
def test_a_hybrids_state_crosses_tensor_parallel_workers(
    references, kind, prefill_tp, decode_tp, backend
):
    model_dir, prompts, want = references(kind)
    cluster = BackendCluster(model_dir, backend, prefill_tp, decode_tp)
    try:
        sent = 0
        for i, p in enumerate(prompts):
            reservation = cluster.reserve(f"tp-{i}", p)
            first = cluster.prefill_req(f"tp-{i}", p, reservation)
            sent += first.bytes_sent
            events = cluster.stream(f"tp-{i}")
            assert [t for e in events for t in e.token_ids] == want[i]
        assert cluster.stats().kv_transfer_bytes == sent
        wait_until(lambda: idle(cluster), 5, f"decode pool not idle: {cluster.stats()}")
    finally:
        cluster.stop()
