"""kvtransfer without a network: wire frames, layouts, re-sharding, and a receiver fed by an engine."""

from __future__ import annotations

import itertools

import msgpack
import pytest
import torch

from helpers.models import random_prompts
from helpers.threads import assert_no_leaks
from pdserve.kvtransfer import (
    ChunkHeader,
    KVLayout,
    LayoutMismatch,
    TransferState,
    decode_frame,
    encode_frame,
)
from pdserve.kvtransfer.layout import overlapping_ranks
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.reshard import read_chunk, write_chunk
from pdserve.kvtransfer.wire import WireError


def frame_bytes(header, payload=b""):
    return b"".join(bytes(p) for p in encode_frame(header, payload))


def test_frame_round_trip_and_refusals():
    h = ChunkHeader(
        "r1", "abc", layer=2, start=3, end=5, head_start=0, head_end=2, head_dim=4, dtype="float32"
    )
    data = torch.arange(2 * 2 * 2 * 4, dtype=torch.float32)
    got, payload = decode_frame(frame_bytes(h, data.numpy().tobytes()))
    assert got == h and torch.equal(torch.frombuffer(bytearray(payload), dtype=torch.float32), data)
    bad_version = msgpack.packb({**h.__dict__, "version": 99})
    with pytest.raises(WireError, match="version 99"):
        decode_frame(len(bad_version).to_bytes(4, "little") + bad_version)
    with pytest.raises(WireError):
        decode_frame(b"\x05\x00\x00\x00garbage")
    with pytest.raises(WireError, match="kind"):
        ChunkHeader("r", "fp", kind="teleport")


def test_a_traced_frame_carries_its_traceparent_and_an_untraced_one_leaves_it_out():
    from pdserve.kvtransfer.backends.frames import encode_header

    parent = "00-" + "4b" * 16 + "-" + "00f067aa0ba902b7" + "-01"
    plain = ChunkHeader("r1", "abc", kind="commit", first_tokens=(7,))
    traced = ChunkHeader("r1", "abc", kind="commit", first_tokens=(7,), traceparent=parent)
    got, _ = decode_frame(frame_bytes(traced))
    assert got.traceparent == parent
    for header in (plain, traced):  # the fast encoder writes the same bytes
        assert encode_header(header) == bytes(encode_frame(header)[1])
    assert "traceparent" not in msgpack.unpackb(encode_header(plain))  # as before the field
    with pytest.raises(WireError, match="traceparent must be a string of at most 64"):
        ChunkHeader("r1", "abc", traceparent="0" * 65)


def test_layout_mismatch_is_refused_with_a_clear_message():
    a = KVLayout("smollm2", "float32", 30, 3, 64, 16)
    b = KVLayout("smollm2", "bfloat16", 30, 3, 64, 16)
    assert (
        a.fingerprint
        == KVLayout("smollm2", "float32", 30, 3, 64, block_size=4, tp_size=3).fingerprint
    )
    with pytest.raises(LayoutMismatch, match="same model in the same dtype"):
        a.check_compatible(b.fingerprint)
    with pytest.raises(ValueError, match="tp_size=2 and num_kv_heads=3: one must divide"):
        KVLayout("m", "float32", 1, 3, 64, 16, tp_size=2)


@pytest.mark.parametrize("heads,tp", [(1, 2), (1, 4), (2, 4)])
def test_fewer_heads_than_ranks_are_held_by_several_and_sent_once(heads, tp):
    """An MLA model's one latent (or each of fewer heads than ranks) is on several ranks: every
    one of them receives it, and only the first of each head's ranks sends it."""
    layouts = [KVLayout("m", "float32", 1, heads, 8, 16, tp_size=tp, tp_rank=r) for r in range(tp)]
    per = tp // heads
    assert [lay.head_range for lay in layouts] == [(r // per, r // per + 1) for r in range(tp)]
    assert [lay.sends for lay in layouts] == [r % per == 0 for r in range(tp)]
    one = KVLayout("m", "float32", 1, heads, 8, 16)  # a TP-1 sender holds every head
    assert overlapping_ranks(one, tp) == list(range(tp))
    assert overlapping_ranks(layouts[-1], tp) == list(range(tp - per, tp))


def make_rank_caches(layout_kw, tp, block_size, num_blocks, seed=0):
    layouts = [
        KVLayout(**layout_kw, block_size=block_size, tp_size=tp, tp_rank=r) for r in range(tp)
    ]
    g = torch.Generator().manual_seed(seed)
    caches = [
        torch.randn(
            layout_kw["num_layers"],
            2,
            num_blocks,
            block_size,
            lay.heads_per_rank,
            layout_kw["head_dim"],
            generator=g,
        )
        for lay in layouts
    ]
    return layouts, caches


def token_view(caches, layouts, block_ids, num_tokens):
    """Global [layers, 2, tokens, all heads, head_dim] view reassembled from every rank."""
    parts = []
    for cache, layout in zip(caches, layouts):
        flat = cache.view(cache.shape[0], 2, -1, layout.heads_per_rank, layout.head_dim)
        t = torch.arange(num_tokens)
        idx = (
            torch.tensor(block_ids)[t // layout.block_size] * layout.block_size
            + t % layout.block_size
        )
        parts.append(flat[:, :, idx])
    return torch.cat(parts, dim=3)


@pytest.mark.parametrize("src_tp,dst_tp", [(3, 1), (1, 3), (2, 3), (6, 2), (1, 1)])
def test_reshard_between_tp_sizes_and_block_sizes(src_tp, dst_tp):
    kw = dict(model="m", dtype="float32", num_layers=2, num_kv_heads=6, head_dim=8)
    num_tokens = 37
    src_layouts, src_caches = make_rank_caches(kw, src_tp, block_size=4, num_blocks=16, seed=1)
    dst_layouts, dst_caches = make_rank_caches(kw, dst_tp, block_size=16, num_blocks=8, seed=2)
    src_blocks = [15, 3, 7, 0, 9, 11, 2, 4, 6, 13]  # 10 blocks of 4 >= 37 tokens
    dst_blocks = [5, 1, 6]  # 3 blocks of 16 >= 37 tokens
    for layer, (start, end) in itertools.product(range(2), [(0, 20), (20, 37)]):
        for layout, cache in zip(src_layouts, src_caches):
            header, data = read_chunk(cache[layer], layout, "r", layer, src_blocks, start, end)
            payload = frame_bytes(header, data.numpy().tobytes())
            header, view = decode_frame(payload)
            for d_layout, d_cache in zip(dst_layouts, dst_caches):
                write_chunk(d_cache, d_layout, dst_blocks, header, view)
    expected = token_view(src_caches, src_layouts, src_blocks, num_tokens)
    assert torch.equal(token_view(dst_caches, dst_layouts, dst_blocks, num_tokens), expected)


def test_receiver_coverage_commit_and_failures():
    layout = KVLayout("m", "float32", num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
    cache = torch.zeros(2, 2, 8, 4, 2, 4)
    src = torch.randn(2, 2, 8, 4, 2, 4)
    rx = KVReceiver(
        "r", cache, layout, block_ids=[0, 1, 2], num_cached_tokens=4, num_prompt_tokens=10
    )
    commit = ChunkHeader("r", layout.fingerprint, kind="commit", first_tokens=(7,))
    header, data = read_chunk(src[0], layout, "r", 0, [0, 1, 2], 4, 10)
    assert rx.on_frame(header, data) == TransferState.TRANSFERRING
    assert rx.on_frame(commit, b"") == TransferState.FAILED  # layer 1 never arrived
    assert "missing" in rx.error

    rx = KVReceiver(
        "r", cache, layout, block_ids=[0, 1, 2], num_cached_tokens=4, num_prompt_tokens=10
    )
    for layer in range(2):
        rx.on_frame(*read_chunk(src[layer], layout, "r", layer, [0, 1, 2], 4, 10))
    assert rx.on_frame(commit, b"") == TransferState.DONE and rx.first_tokens == (7,)

    rx = KVReceiver(
        "r", cache, layout, block_ids=[0, 1, 2], num_cached_tokens=0, num_prompt_tokens=10
    )
    wrong = ChunkHeader(
        "r", "0000", layer=0, start=0, end=2, head_start=0, head_end=2, head_dim=4, dtype="float32"
    )
    assert rx.on_frame(wrong, torch.zeros(2, 2, 2, 4)) == TransferState.FAILED
    assert "same model" in rx.error
    rx = KVReceiver(
        "r", cache, layout, block_ids=[0, 1, 2], num_cached_tokens=0, num_prompt_tokens=10
    )
    assert (
        rx.on_frame(ChunkHeader("r", layout.fingerprint, kind="abort"), b"") == TransferState.FAILED
    )


class FramingSink:
    """Engine KVSink -> wire frames -> a receiver on another engine: the hand-off minus the network."""

    def __init__(self, layout, receiver):
        self.layout, self.receiver = layout, receiver

    def on_layer(self, layer, layer_kv, block_ids, start, end):
        start = max(start, self.receiver.num_cached_tokens)
        if start < end:
            header, data = read_chunk(
                layer_kv, self.layout, self.receiver.request_id, layer, block_ids, start, end
            )
            self.receiver.on_frame(*decode_frame(frame_bytes(header, data.numpy().tobytes())))


def test_engine_to_engine_through_frames(tiny_models):
    from pdserve.engine import LLM, SamplingParams

    model_dir, _ = tiny_models("llama-gqa")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = random_prompts([45, 3, 70], seed=5)
    expected = LLM(model_dir, kv_cache_memory=1 << 22).generate(prompts, params, use_tqdm=False)
    prefill = LLM(
        model_dir, kv_cache_memory=1 << 22, block_size=4, max_num_batched_tokens=32
    ).engine
    decode = LLM(model_dir, kv_cache_memory=1 << 22, block_size=16).engine
    mc = decode.model_config
    layout = lambda bs: KVLayout("tiny", "float32", mc.num_layers, mc.num_kv_heads, mc.head_dim, bs)  # noqa: E731
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        rid = f"r{i}"
        res = decode.reserve(rid, prompt, params)
        rx = KVReceiver(
            rid, decode.kv_cache, layout(16), res.block_ids, res.num_cached_tokens, len(prompt)
        )
        prefill.add_request(
            rid, prompt, params, prefill_only=True, kv_sink=FramingSink(layout(4), rx)
        )
        first = None
        while prefill.has_unfinished_requests():
            for out in prefill.step():
                first = out.outputs[0].token_ids[0]
        commit = ChunkHeader(rid, layout(4).fingerprint, kind="commit", first_tokens=(first,))
        assert rx.on_frame(commit, b"") == TransferState.DONE, rx.error
        decode.commit(rid, list(rx.first_tokens))
        got = None
        while decode.has_unfinished_requests():
            for out in decode.step():
                got = out
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert_no_leaks(prefill)
    assert_no_leaks(decode)
