"""A decode side's KVReceiver checks each header against its own layout before it takes a frame: an
in-place header (the shm backend's, with no payload) that names a layer, head dim, dtype, head
range or token range the reservation does not have fails the request. What a stranger can send to a
KV server: tests/integration/test_kv_security.py."""

from __future__ import annotations

import dataclasses

import torch

from helpers.kv import NUM_TOKENS, src_layout
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
