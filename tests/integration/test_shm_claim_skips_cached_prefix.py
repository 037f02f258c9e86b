"""Over a real shm control server (kvtransfer/backends/claims.py, receiver.py): a reservation
whose first block holds the decode side's cached prefix hands out claims that cover the blocks
after it alone (the claim's reply says so), and an in-place frame that reports a write into the
cached block fails the request with the reason. Unit checks: tests/unit/test_cached_prefix_not_written.py.
"""

from __future__ import annotations

from helpers.kv import DST_BLOCK_SIZE, NUM_TOKENS, DecodeSide
from pdserve.kvtransfer import ChunkHeader
from pdserve.kvtransfer.backends.claims import ask_claim_cover
from pdserve.kvtransfer.backends.grpc_sender import GrpcTransport
from pdserve.kvtransfer.backends.shm_backend import parse_address
from pdserve.kvtransfer.receiver import KVReceiver


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
