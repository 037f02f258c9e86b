"""kvtransfer.backend "auto" without sockets: which offers a prefill worker may use
(kvtransfer/choose.py), and when a decode worker puts its KV pool in a shared file so that it can
offer shm at all (DecodePart.shared_dir). The cluster over both: tests/integration/test_kv_auto.py."""

from __future__ import annotations

import logging

from pdserve.decode_worker.server import DecodePart, DecodeWorkerConfig
from pdserve.kvtransfer import choose
from pdserve.protos.pdserve.v1 import worker_pb2


def endpoint_with(*offers):
    e = worker_pb2.KVEndpoint(backend="grpc", address="127.0.0.1:1")
    for backend, locality in offers:
        e.offers.add(backend=backend, address=f"{backend}-address", locality=locality)
    return e


def test_the_best_usable_offer_comes_first(monkeypatch):
    monkeypatch.setattr(choose, "locality", lambda address: "boot:1:2")
    here = endpoint_with(("grpc", ""), ("shm", "boot:1:2"))
    assert [o.backend for o in choose.choices(here)] == ["shm", "grpc"]
    elsewhere = endpoint_with(("shm", "other-boot:1:2"), ("grpc", ""))
    assert [o.backend for o in choose.choices(elsewhere)] == ["grpc"]
    unknown = endpoint_with(("nixl", ""), ("torch", ""))  # not auto's: never picked from offers
    assert choose.choices(unknown) == []
    plain = endpoint_with()  # a decode worker on one named backend
    assert choose.choices(plain) == [plain]


def test_an_shm_offer_whose_pool_this_host_cannot_see_does_not_apply():
    offer = worker_pb2.KVEndpoint(backend="shm", address="not an shm address", locality="x")
    assert not choose.applies(offer)


def auto_part(**engine):
    return DecodePart(DecodeWorkerConfig(model="m", kv_backend="auto", engine_kwargs=engine))


def test_auto_shares_the_pool_only_where_it_fits_in_host_memory(caplog):
    caplog.set_level(logging.INFO, "pdserve.decode_worker.server")
    assert auto_part(kv_cache_memory=1 << 20).shared_dir(1) is not None
    assert auto_part(device="cuda").shared_dir(1) is None  # a GPU pool is not a file
    assert auto_part(kv_cache_memory=1 << 50).shared_dir(1) is None  # no room: grpc alone
    assert "offers grpc only" in caplog.text and "--shm-size" in caplog.text
    assert auto_part(kv_cache_memory=1 << 50).shared_dir(2) is not None  # TP needs the file
    named = DecodePart(DecodeWorkerConfig(model="m", kv_backend="grpc"))
    assert named.shared_dir(1) is None
