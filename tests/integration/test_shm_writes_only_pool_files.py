"""What a reservation's shm endpoint can make a prefill worker write, over a real shm control
server on 127.0.0.1 (kvtransfer/choose.py, kvtransfer/backends/shm_backend.py).

A named shm endpoint that points at some other file than a decode worker's pool (a plain file of
the right size, outside the shared folder) is never taken, so that file is left as it was (and
the prefill worker refuses a shm endpoint without its write grant:
tests/unit/test_prefill_endpoint_checks.py). An endpoint that joins one decode worker's pool file
with another's control address and grant is refused at the claim, before any write: the claim's
reply names the granting worker's pool. A real pool with its grant still takes the push whole.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers.kv import (
    CONNECT_TIMEOUT,
    DecodeSide,
    push_request,
)
from pdserve.kvtransfer.backends import connect
from pdserve.kvtransfer.backends.shm_backend import format_address, locality, parse_address
from pdserve.kvtransfer.choose import choices
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
    assert locality(address) == ""  # nor would it take the file for a pool it sees
    assert victim.read_bytes() == before
    assert side.frames == []


def test_a_pool_with_its_grant_takes_the_push(side):
    endpoint = _endpoint(side.server.address)
    assert [e.address for e in choices(endpoint)] == [side.server.address]
    tx = connect("shm", side.server.address, timeout=CONNECT_TIMEOUT)
    try:
        dest = side.reserve("r", [0, 1, 2])
        push_request(tx, "r", 7, dest)
        tx.flush(CONNECT_TIMEOUT)
        side.assert_received("r", 7)
    finally:
        tx.close()


def test_a_grant_from_one_pool_never_writes_into_another_pools_file(side):
    other = DecodeSide("shm")  # a second decode worker on this host, its own pool and control
    try:
        paths, shape, dtype, _ = parse_address(other.server.address)
        control = parse_address(side.server.address)[3]
        joined = format_address(paths, shape, dtype, control)
        assert locality(joined) != ""  # the file is a real pool: only the claim can tell
        other.cache.fill_(7.0)
        dest = side.reserve("r", [0, 1, 2])  # the grant of `side`'s reservation
        tx = connect("shm", joined, timeout=CONNECT_TIMEOUT)
        try:
            with pytest.raises(PermissionError, match="serves another KV pool"):
                push_request(tx, "r", 7, dest)
        finally:
            tx.close()
        assert bool((other.cache == 7.0).all())  # not one byte of the other pool written
        assert other.frames == []
    finally:
        other.close()
