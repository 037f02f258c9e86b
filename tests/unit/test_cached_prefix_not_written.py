"""No KV frame or claimed write reaches a reservation's cached prefix (kvtransfer/receiver.py,
kvtransfer/backends/claims.py, nixl_backend.py): those blocks come from the decode worker's
prefix cache and other requests may share them. A frame starting before the cached tokens fails
its request before anything is written; a write grant covers only the blocks past the cached
prefix, the claim's reply says from which block on, and the nixl sender posts no WRITE before it.
Without sockets, NIXL or a model; over a real shm control server:
tests/integration/test_shm_claim_skips_cached_prefix.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgpack
import pytest
import torch

from pdserve.kvtransfer.backends.claims import (
    ClaimsControl,
    Grants,
    ask_claim_cover,
)
from pdserve.kvtransfer.backends.nixl_backend import NixlTransport, _Outgoing
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.reshard import read_chunk
from pdserve.kvtransfer.state import TransferState
from pdserve.kvtransfer.transport import Destination
from pdserve.kvtransfer.wire import ChunkHeader

LAYOUT = KVLayout("m", "float32", num_layers=1, num_kv_heads=2, head_dim=4, block_size=4)


def test_a_frame_before_the_cached_tokens_fails_and_leaves_the_shared_block_alone():
    """The review's case (s1): block 5 holds the 4 cached tokens, shared with other requests;
    a frame of tokens [0, 10) fails the request and block 5 is as it was. From the cached
    count on, frames are taken as before."""
    cache = torch.zeros(1, 2, 8, 4, 2, 4)
    cache[0, :, 5] = 7.0
    src = torch.randn(1, 2, 8, 4, 2, 4)
    for start in (0, 3):
        rx = KVReceiver("r", cache, LAYOUT, [5, 1, 2], num_cached_tokens=4, num_prompt_tokens=10)
        header, data = read_chunk(src[0], LAYOUT, "r", 0, [0, 1, 2], start, 10)
        assert rx.on_frame(header, data) == TransferState.FAILED
        assert "4 cached prompt tokens" in rx.error and "from 4 on" in rx.error, rx.error
        assert torch.all(cache[0, :, 5] == 7.0)
    rx = KVReceiver("r", cache, LAYOUT, [5, 1, 2], num_cached_tokens=4, num_prompt_tokens=10)
    in_place = ChunkHeader("r", LAYOUT.fingerprint, 0, 2, 10, 0, 2, 4, "float32", in_place=True)
    assert rx.on_frame(in_place, None) == TransferState.FAILED  # shm, nixl: refused as well
    rx = KVReceiver("r", cache, LAYOUT, [5, 1, 2], num_cached_tokens=4, num_prompt_tokens=10)
    header, data = read_chunk(src[0], LAYOUT, "r", 0, [0, 1, 2], 4, 10)
    assert rx.on_frame(header, data) == TransferState.TRANSFERRING and rx.error is None
    assert torch.all(cache[0, :, 5] == 7.0) and rx.complete


class Aborted(Exception):
    pass


class Context:
    def peer(self):
        return "ipv4:127.0.0.1:1"

    def abort(self, code, details):
        raise Aborted(code, details)


class Control:
    """A control channel whose KVClaim is answered by `ClaimsControl._claim` over `grants`."""

    def __init__(self, grants, reply=None):
        self.grants, self.reply = grants, reply

    def call(self, method, request, timeout):
        if self.reply is not None:
            return msgpack.packb(self.reply)
        return ClaimsControl._claim(
            SimpleNamespace(grants=self.grants, _pool=None), request, Context()
        )


def test_a_claim_covers_only_the_blocks_past_the_cached_prefix():
    grants = Grants()
    with pytest.raises(ValueError, match="first_block 4"):
        grants.issue("r0", [1, 2, 3], first_block=4)
    token = grants.issue("r1", [5, 1, 2], first_block=1)
    assert grants.first_block("r1") == 1 and grants.first_block("unknown") == 0
    control = Control(grants)
    assert ask_claim_cover(control, "r1", token, [5, 1, 2], "a", None, 1.0) == (
        grants.window_s,
        1,
    )
    assert ask_claim_cover(control, "r1", token, [5, 1, 2], "b", None, 1.0)[0] == grants.window_s
    # an older decode worker says nothing: all blocks; a reply out of range is not believed
    old = Control(grants, {"window_s": 60.0})
    assert ask_claim_cover(old, "r1", token, [5, 1, 2], "a", None, 1.0) == (60.0, 0)
    bad = Control(grants, {"window_s": 60.0, "first_block": 4})
    with pytest.raises(ConnectionError, match="first block 4"):
        ask_claim_cover(bad, "r1", token, [5, 1, 2], "a", None, 1.0)


def nixl_sender() -> NixlTransport:
    """The parts of a NixlTransport its chunk checks read (its receiver's pool: 1 layer, 8
    blocks of 4 tokens, 2 heads of 4), without NIXL."""
    tx = object.__new__(NixlTransport)
    tx.shape, tx.tp = (1, 2, 8, 4, 2, 4), 1
    return tx


def test_the_nixl_sender_writes_nothing_into_the_cached_blocks():
    tx = nixl_sender()
    dest = Destination([5, 1, 2], LAYOUT, grant="g")
    out = _Outgoing((5, 1, 2), "g", time.monotonic() + 60, 60.0, first_block=1)
    for start in (0, 3):
        header = ChunkHeader("r", LAYOUT.fingerprint, 0, start, 10, 0, 2, 4, "float32")
        with pytest.raises(ValueError, match="cached prefix"):
            tx._check_chunk(header, dest, out)
    tx._check_chunk(ChunkHeader("r", LAYOUT.fingerprint, 0, 4, 10, 0, 2, 4, "float32"), dest, out)
