"""What a reservation's shm endpoint can make a prefill worker write, over a real shm control
server on 127.0.0.1 (kvtransfer/choose.py, kvtransfer/backends/shm_backend.py).

A named shm endpoint that points at some other file than a decode worker's pool (a plain file of
the right size, outside the shared folder) is never taken, and a sender writes nothing without
the reservation's write grant, so that file is left as it was. A real pool with its grant still
takes the push whole.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers.kv import (
    CONNECT_TIMEOUT,
    SRC_BLOCK_IDS,
    DecodeSide,
    push_request,
    source_cache,
    src_layout,
)
from pdserve.kvtransfer.backends import connect
from pdserve.kvtransfer.backends.shm_backend import format_address, parse_address
from pdserve.kvtransfer.choose import choices
from pdserve.kvtransfer.reshard import read_chunk
from pdserve.kvtransfer.transport import Destination
from pdserve.protos.pdserve.v1 import worker_pb2


@pytest.fixture
def side():
    decode = DecodeSide("shm")
    yield decode
    decode.close()


def _endpoint(address: str, grant: str = "") -> worker_pb2.KVEndpoint:
    return worker_pb2.KVEndpoint(backend="shm", address=address, write_grant=grant)


def test_a_plain_file_named_by_a_reservation_is_neither_taken_nor_written(side, tmp_path):
    _, shape, dtype, control = parse_address(side.server.address)
    victim = tmp_path / "victim.bin"
    before = b"A" * (math.prod(shape) * torch.empty((), dtype=dtype).element_size())
    victim.write_bytes(before)
    address = format_address(str(victim), shape, dtype, control)
    dest = side.reserve("r", [0, 1, 2])
    assert choices(_endpoint(address, dest.grant)) == []  # the prefill worker never connects
    # and a sender asked to write there anyway without the grant writes nothing
    tx = connect("shm", address, timeout=CONNECT_TIMEOUT)
    try:
        header, data = read_chunk(source_cache(1)[0], src_layout(), "r", 0, SRC_BLOCK_IDS, 0, 20)
        with pytest.raises(PermissionError, match="write grant"):
            tx.send(header, data, Destination(dest.block_ids, dest.layout, grant=""))
    finally:
        tx.close()
    assert victim.read_bytes() == before
    assert side.frames == []


def test_a_pool_with_its_grant_takes_the_push_and_one_without_is_refused(side):
    endpoint = _endpoint(side.server.address)
    assert [e.address for e in choices(endpoint)] == [side.server.address]
    tx = connect("shm", side.server.address, timeout=CONNECT_TIMEOUT)
    try:
        dest = side.reserve("r", [0, 1, 2])
        ungranted = Destination(dest.block_ids, dest.layout, grant="")
        header, data = read_chunk(source_cache(1)[0], src_layout(), "r", 0, SRC_BLOCK_IDS, 0, 20)
        with pytest.raises(PermissionError, match="write grant"):
            tx.send(header, data, ungranted)
        assert not side.cache[:, :, dest.block_ids].any()
        push_request(tx, "r", 7, dest)
        tx.flush(CONNECT_TIMEOUT)
        side.assert_received("r", 7)
    finally:
        tx.close()
