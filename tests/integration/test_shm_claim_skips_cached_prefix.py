"""Over a real shm control server (kvtransfer/backends/claims.py, receiver.py): a reservation
whose first block holds the decode side's cached prefix hands out claims that cover the blocks
after it alone (the claim's reply says so), and an in-place frame that reports a write into the
cached block fails the request with the reason; a ShmTransport copies nothing into that block.
Unit checks: tests/unit/test_cached_prefix_not_written.py.
"""

from __future__ import annotations

import pytest
import torch

from helpers.kv import (
    DST_BLOCK_SIZE,
    NUM_TOKENS,
    TOKEN_RANGES,
    DecodeSide,
    source_cache,
    src_layout,
)
from pdserve.kvtransfer import ChunkHeader
from pdserve.kvtransfer.backends import connect
from pdserve.kvtransfer.backends.claims import ask_claim_cover
from pdserve.kvtransfer.backends.grpc_sender import GrpcTransport
from pdserve.kvtransfer.backends.shm_backend import parse_address
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.reshard import read_chunk
from pdserve.kvtransfer.transport import Destination


def test_a_claim_does_not_cover_the_cached_block_and_a_write_there_fails_the_request():
    side = DecodeSide("shm")
    _, _, _, control = parse_address(side.server.address)
    raw = GrpcTransport(control)
    try:
        blocks = [4, 6, 2]
        side.receivers["r1"] = KVReceiver("r1", side.cache, side.layout, blocks, 16, NUM_TOKENS)
        grant = side.grants.issue("r1", blocks, first_block=16 // DST_BLOCK_SIZE)
        window_s, first = ask_claim_cover(raw, "r1", grant, blocks, "agent", None, 5.0)
        assert first == 1 and window_s == side.grants.window_s
        header = ChunkHeader(
            "r1", side.layout.fingerprint, 0, 0, 20, 0, 2, 8, "float32", in_place=True,
            grant=grant,
        )  # fmt: skip
        raw.send_headers([header])
        raw.flush(5)
        rx = side.wait_finished("r1")
        assert rx.error and "16 cached prompt tokens" in rx.error, rx.error
    finally:
        raw.close()
        side.close()


def test_a_shm_sender_copies_nothing_into_the_cached_blocks():
    side = DecodeSide("shm")
    tx = connect("shm", side.server.address)
    try:
        blocks = [4, 6, 2]
        side.receivers["r2"] = KVReceiver("r2", side.cache, side.layout, blocks, 16, NUM_TOKENS)
        grant = side.grants.issue("r2", blocks, first_block=16 // DST_BLOCK_SIZE)
        dest = Destination(blocks, side.layout, grant=grant)
        start, end = TOKEN_RANGES[0]  # tokens 0-19: the first 16 are the cached block's
        header, data = read_chunk(source_cache(1)[0], src_layout(), "r2", 0, [11, 3], start, end)
        before = side.cache.clone()
        with pytest.raises(ValueError, match="cached prefix"):
            tx.send(header, data, dest)
        assert torch.equal(side.cache, before)  # nothing copied, the shared block least of all
        assert side.wait_finished("r2").error  # and the decode side was told to fail it
    finally:
        tx.close()
        side.close()
