"""A decode side's KVReceiver checks each header against its own layout before it takes a frame (and
a hybrid model's reservation its recurrent state's frames): an
in-place header (the shm backend's, with no payload) that names a layer, head dim, dtype, head
range or token range the reservation does not have fails the request. What a stranger can send to a
KV server: tests/integration/test_kv_security.py. An EAGLE head's "draft" chunks are checked
against the head's own layout."""

from __future__ import annotations

import dataclasses

import torch

from helpers.kv import NUM_TOKENS, src_layout
from pdserve.engine.recurrent_state import RecurrentStates, SlotState
from pdserve.kvtransfer import ChunkHeader, TransferState
from pdserve.kvtransfer.receiver import KVReceiver


def test_the_receiver_checks_an_in_place_header_against_its_layout():
    layout = dataclasses.replace(src_layout(), block_size=16)
    cache = torch.zeros(3, 2, 4, 16, 2, 8)
    ok = ChunkHeader("r", layout.fingerprint, 0, 0, 10, 0, 2, 8, "float32", in_place=True)
    for bad, complaint in [
        (dict(layer=3), "layer 3"),
        (dict(head_dim=4), "head_dim"),
        (dict(dtype="bfloat16"), "dtype"),
        (dict(head_end=3), "kv heads"),
        (dict(start=10), "non-empty"),
        (dict(end=NUM_TOKENS + 1), "non-empty"),
    ]:
        rx = KVReceiver("r", cache, layout, [0, 1, 2], 0, NUM_TOKENS)
        assert rx.on_frame(dataclasses.replace(ok, **bad), None) == TransferState.FAILED
        assert complaint in rx.error, rx.error
    rx = KVReceiver("r", cache, layout, [0, 1, 2], 0, NUM_TOKENS)
    assert rx.on_frame(ok, b"\0" * 4) == TransferState.FAILED and "no payload" in rx.error
    rx = KVReceiver("r", cache, layout, [0, 1, 2], 0, NUM_TOKENS)
    assert rx.on_frame(ok, None) == TransferState.TRANSFERRING  # what the shm server passes


def test_a_hybrid_reservation_takes_each_linear_layers_state_once_before_its_commit():
    """A hybrid model's reservation (a slot's [conv, ssm] per linear layer) is complete only
    with every layer's "state" frame: a commit before them fails the request; a frame of the
    wrong size, of a layer the model does not have, a second one for a layer, or one for a
    model without state fails it too; the values land in the slot."""
    layout = dataclasses.replace(src_layout(), block_size=16)
    cache = torch.zeros(3, 2, 4, 16, 2, 8)
    kv = [
        ChunkHeader(
            "r", layout.fingerprint, layer, 0, NUM_TOKENS, 0, 2, 8, "float32", in_place=True
        )
        for layer in range(3)
    ]

    def receiver(states=True):
        pool = RecurrentStates([((3, 4), (2, 2, 2))] * 2, 2, "cpu")
        slots = [SlotState([pool], [], layer, 1) for layer in range(2)] if states else None
        rx = KVReceiver("r", cache, layout, [0, 1, 2], 0, NUM_TOKENS, slots)
        for header in kv:
            rx.on_frame(header, None)
        return rx, pool.views(1)

    state = ChunkHeader("r", layout.fingerprint, 1, dtype="float32", kind="state")
    commit = ChunkHeader("r", layout.fingerprint, kind="commit", first_tokens=(5,))
    values = torch.arange(20, dtype=torch.float32)
    rx, _ = receiver()
    assert rx.on_frame(state, values.numpy().tobytes()) == TransferState.TRANSFERRING
    assert rx.on_frame(commit, None) == TransferState.FAILED
    assert "1 layers' recurrent state" in rx.error
    for bad, payload, complaint in [
        (dict(layer=2), values, "outside the model's 2"),
        (dict(dtype="bfloat16"), values, "float32"),
        ({}, values[:19], "this model's state is 20"),
    ]:
        rx, _ = receiver()
        assert rx.on_frame(dataclasses.replace(state, **bad), payload) == TransferState.FAILED
        assert complaint in rx.error, rx.error
    rx, _ = receiver()
    rx.on_frame(state, values)
    assert rx.on_frame(state, values) == TransferState.FAILED and "second" in rx.error
    rx, _ = receiver(states=False)
    assert rx.on_frame(state, values) == TransferState.FAILED and "no recurrent" in rx.error
    rx, views = receiver()
    kv_bytes = rx.bytes_received
    for layer in (0, 1):
        rx.on_frame(dataclasses.replace(state, layer=layer), (values + layer).numpy().tobytes())
    assert rx.on_frame(commit, None) == TransferState.DONE
    assert torch.equal(views[1][0].view(-1), values[:12] + 1)
    assert torch.equal(views[1][1].view(-1), values[12:] + 1)
    assert rx.bytes_received == kv_bytes + 2 * 20 * 4


def test_an_eagle_heads_draft_chunks_land_in_its_cache_checked_and_the_commit_goes_on():
    """A reservation with an EAGLE head (`draft`: its cache and layout) writes "draft" chunks into
    the head's cache at the reservation's blocks, checked against the head's own layout: another
    layer, dtype or a token range outside the uncached prompt fails the request. The commit does
    not wait for them (`draft_complete` says whether all came); a receiver without a head, or
    with another head (another fingerprint), ignores them."""
    layout = dataclasses.replace(src_layout(), block_size=16)
    cache = torch.zeros(3, 2, 4, 16, 2, 8)
    head = dataclasses.replace(layout, model="eagle:h", num_layers=1)
    head_cache = torch.zeros(1, 2, 4, 16, 2, 8)
    kv = [
        ChunkHeader(
            "r", layout.fingerprint, layer, 0, NUM_TOKENS, 0, 2, 8, "float32", in_place=True
        )
        for layer in range(3)
    ]
    draft = ChunkHeader("r", head.fingerprint, 0, 4, NUM_TOKENS, 0, 2, 8, "float32", kind="draft")
    payload = torch.arange(2 * (NUM_TOKENS - 4) * 16, dtype=torch.float32).view(draft.shape)
    commit = ChunkHeader("r", layout.fingerprint, kind="commit", first_tokens=(5,))

    def receiver(with_head=True, cached=0):
        rx = KVReceiver(
            "r", cache, layout, [0, 1, 2], cached, NUM_TOKENS, None,
            (head_cache, head) if with_head else None,
        )  # fmt: skip
        for header in kv:
            rx.on_frame(dataclasses.replace(header, start=cached), None)
        return rx

    rx = receiver()
    assert rx.on_frame(draft, payload) == TransferState.TRANSFERRING
    written = head_cache[0].reshape(2, -1, 2, 8)[:, 4:NUM_TOKENS]  # (blocks 0, 1, 2 in order)
    assert torch.equal(written, payload)
    assert not rx.draft_complete  # tokens 0..3 never came
    assert rx.on_frame(commit, None) == TransferState.DONE
    rx = receiver(cached=4)  # a cached prefix: the chunk covers the rest
    assert rx.on_frame(draft, payload) == TransferState.TRANSFERRING and rx.draft_complete
    for bad, complaint in [
        (dict(layer=1), "layer 1"),
        (dict(dtype="bfloat16"), "dtype"),
        (dict(start=0), "uncached"),
        (dict(end=NUM_TOKENS + 1), "uncached"),
    ]:
        rx = receiver(cached=2)
        assert rx.on_frame(dataclasses.replace(draft, **bad), payload) == TransferState.FAILED
        assert complaint in rx.error, rx.error
    rx = receiver()
    assert rx.on_frame(draft, payload[:, :-1]) == TransferState.FAILED
    for rx, header in (
        (receiver(with_head=False), draft),
        (receiver(cached=4), dataclasses.replace(draft, fingerprint=layout.fingerprint)),
    ):
        assert rx.on_frame(header, payload) == TransferState.TRANSFERRING
        assert not rx.draft_complete
        assert rx.on_frame(commit, None) == TransferState.DONE
