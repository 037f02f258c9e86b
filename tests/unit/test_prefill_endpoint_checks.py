"""A prefill worker's checks of a reservation's KV endpoint, and its channel table, without
sockets (prefill_worker/service.py, kvtransfer/choose.py, kvtransfer/backends/shm_backend.py).

An endpoint's tp_size must divide the model's KV heads (INVALID_ARGUMENT, not the UNKNOWN of a
ValueError deep in the hand-off). A shm endpoint needs its write grant, and one named without
offers must name a decode worker's pool file (KV_FILE_PREFIX, directly in the shared folder), so a
reservation cannot make the worker map and write some other file. A channel being opened to one
decode endpoint holds up no call to another.
"""

from __future__ import annotations

import os
import threading
import types
import uuid

import grpc
import pytest
import torch

from pdserve.kvpool import KV_FILE_PREFIX
from pdserve.kvtransfer import choose
from pdserve.kvtransfer.backends import shm_backend
from pdserve.kvtransfer.backends.shm_backend import (
    create_shared_kv_cache,
    default_shared_dir,
    format_address,
    pool_file_problem,
    remove_shared_kv_cache,
)
from pdserve.kvtransfer.layout import KVLayout
from pdserve.prefill_worker import service
from pdserve.prefill_worker.service import PrefillServiceOptions, PrefillWorkerServicer
from pdserve.protos.pdserve.v1 import worker_pb2

LAYOUT = KVLayout("m", "float32", num_layers=2, num_kv_heads=8, head_dim=4, block_size=4)
SHAPE = (2, 2, 4, 4, 8, 4)  # one rank's pool: layers, k/v, blocks, block size, heads, head dim
WAIT_S = 30.0  # a guard against a hang, never a measure


def _servicer() -> PrefillWorkerServicer:
    engine = types.SimpleNamespace(config=types.SimpleNamespace(pipeline_parallel_size=1))
    loop = types.SimpleNamespace(engine=engine, every=lambda *args: None)
    return PrefillWorkerServicer(loop, LAYOUT, PrefillServiceOptions())


def _request(endpoint: worker_pb2.KVEndpoint) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(
        request_id="r",
        prompt_token_ids=[1, 2, 3, 4, 5],
        reservation=worker_pb2.ReserveResponse(
            request_id="r", block_ids=[0, 1], block_size=4, endpoint=endpoint
        ),
    )


def _refusal(endpoint: worker_pb2.KVEndpoint) -> tuple[grpc.StatusCode, str] | None:
    refusal = _servicer()._check_reservation(_request(endpoint))
    return None if refusal is None else (refusal.code, refusal.message)


def _shm(path: str, **fields) -> worker_pb2.KVEndpoint:
    address = format_address(path, SHAPE, torch.float32, "127.0.0.1:1")
    return worker_pb2.KVEndpoint(
        backend="shm", address=address, layout_fingerprint=LAYOUT.fingerprint, **fields
    )


@pytest.fixture
def pool():
    """A decode worker's pool file, where decode workers put theirs."""
    _, path = create_shared_kv_cache(SHAPE, torch.float32)
    yield path
    remove_shared_kv_cache(path)


@pytest.fixture
def plain_file(tmp_path):
    """A file of a pool's size that is no pool: the reservation must not get it written."""
    path = tmp_path / "victim.bin"
    path.write_bytes(b"A" * (4 * 2 * 2 * 4 * 4 * 8 * 4))
    return str(path)


@pytest.mark.parametrize("tp_size", [3, 5, 16])
def test_a_tp_size_that_does_not_divide_the_kv_heads_is_invalid(tp_size):
    endpoint = worker_pb2.KVEndpoint(backend="grpc", address="127.0.0.1:1", tp_size=tp_size)
    code, message = _refusal(endpoint)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"reservation.endpoint.tp_size={tp_size} must divide the model's 8 KV heads" in message
    offered = worker_pb2.KVEndpoint(backend="grpc", address="127.0.0.1:1")
    offered.offers.add(backend="grpc", address="127.0.0.1:1", tp_size=tp_size)
    code, message = _refusal(offered)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "offers[0].tp_size" in message
    for fine in (0, 1, 2, 4, 8):
        assert _refusal(worker_pb2.KVEndpoint(backend="grpc", address="x", tp_size=fine)) is None


def test_a_named_shm_endpoint_must_name_a_pool_file(plain_file, pool):
    code, message = _refusal(_shm(plain_file, write_grant="g"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a KV pool file" in message and KV_FILE_PREFIX in message
    assert default_shared_dir() in message
    assert open(plain_file, "rb").read() == b"A" * os.path.getsize(plain_file)
    assert _refusal(_shm(pool, write_grant="g")) is None


def test_a_shm_endpoint_without_its_write_grant_is_invalid(pool):
    code, message = _refusal(_shm(pool))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "write_grant" in message
    offered = worker_pb2.KVEndpoint(backend="grpc", address="127.0.0.1:1")
    offered.offers.append(_shm(pool))
    code, message = _refusal(offered)
    assert "reservation.endpoint.offers[0].write_grant" in message


def test_a_sender_takes_a_named_shm_endpoint_only_for_a_pool_file_it_sees(plain_file, pool):
    assert choose.choices(_shm(plain_file, write_grant="g")) == []
    assert [e.address for e in choose.choices(_shm(pool))] == [_shm(pool).address]
    here = shm_backend.locality(_shm(pool).address)
    assert choose.choices(_shm(pool, locality=here))  # the same view of the file
    assert choose.choices(_shm(pool, locality="another-boot:1:2")) == []
    gone = os.path.join(default_shared_dir(), f"{KV_FILE_PREFIX}{uuid.uuid4().hex}")
    assert choose.choices(_shm(gone)) == []  # nothing to map here
    # an offer naming another file is passed over, like one of another host
    offered = worker_pb2.KVEndpoint(backend="grpc", address="127.0.0.1:1")
    offered.offers.append(_shm(plain_file, locality=shm_backend._boot_id()))
    offered.offers.add(backend="grpc", address="127.0.0.1:1")
    assert [o.backend for o in choose.choices(offered)] == ["grpc"]


def test_only_regular_pool_files_in_the_shared_folder_may_be_mapped(tmp_path, plain_file, pool):
    shared = default_shared_dir()
    assert pool_file_problem(pool) is None
    link = os.path.join(shared, f"{KV_FILE_PREFIX}{uuid.uuid4().hex}-link")
    os.symlink(plain_file, link)
    try:
        assert "not a regular file" in pool_file_problem(link)
    finally:
        os.unlink(link)
    name = os.path.basename(pool)
    for path in (
        str(tmp_path / name),  # a pool's name in another folder
        os.path.join(shared, "victim.bin"),  # the shared folder, not a pool's name
        os.path.join(shared, "sub", "..", name),  # not a normalized path
        name,  # relative
    ):
        assert "not a KV pool file" in pool_file_problem(path), path


def test_a_channel_being_opened_holds_up_no_call_to_another_endpoint(monkeypatch):
    svc = _servicer()
    release, entered = threading.Event(), threading.Event()
    connects = []

    def fake_connect(backend, address, timeout, security):
        connects.append(address)
        if address == "slow:1":
            entered.set()
            assert release.wait(WAIT_S), "the test never released the slow connect"
        if address == "dead:1":
            raise ConnectionError("dead:1 does not answer")
        return types.SimpleNamespace(address=address, close=lambda: None)

    monkeypatch.setattr(service, "connect", fake_connect)
    open_b = svc._transport("grpc", "open:1")
    got = {}

    def call(n, address):
        try:
            got[n] = svc._transport("grpc", address)
        except ConnectionError as e:
            got[n] = e

    first = threading.Thread(target=call, args=(1, "slow:1"))
    first.start()
    assert entered.wait(WAIT_S)
    second = threading.Thread(target=call, args=(2, "slow:1"))  # waits for the same opening
    second.start()
    # while slow:1's connect is blocked, a call to the open channel and a new one go through
    assert svc._transport("grpc", "open:1") is open_b
    assert svc._transport("grpc", "other:1").address == "other:1"
    assert not release.is_set() and first.is_alive()
    release.set()
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert got[1] is got[2] and got[1].address == "slow:1"
    assert connects.count("slow:1") == 1  # one connect, shared
    # a failed opening raises and leaves nothing behind: the next call tries again
    for n in (3, 4):
        call(n, "dead:1")
        assert isinstance(got[n], ConnectionError)
    assert connects.count("dead:1") == 2
    assert svc._transport("grpc", "slow:1") is got[1] and not svc._opening
