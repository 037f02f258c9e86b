"""The nixl backend's trust and lifecycle over 127.0.0.1 (issue 50, must-show d): a forged or
replayed write grant, a claim of blocks outside the reservation and a forged frame are refused
with nothing written; a peer without the cluster secret gets no metadata; a sender's write window
ends its writes; and a decode worker holds back the blocks of a reservation it ended while a
claim may still write, until the sender's last frame. Skipped where NIXL is not installed."""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest
import torch

from helpers.models import random_prompts
from helpers.threads import wait_until
from helpers.worker import GREEDY, start_decode
from pdserve.kvtransfer.backends import connect, serve
from pdserve.kvtransfer.backends.claims import Grants
from pdserve.kvtransfer.backends.grpc_sender import GrpcTransport
from pdserve.kvtransfer.backends.nixl_backend import METADATA_METHOD, nixl_available, parse_address
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.receiver import WorkerReceiver
from pdserve.kvtransfer.reshard import read_chunk
from pdserve.kvtransfer.transport import Destination, RefusedFrame
from pdserve.kvtransfer.wire import ChunkHeader
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.protos.security import INSECURE, ClusterSecurity

pytestmark = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed: pip install 'pdserve[nixl]'"
)

SECURITY = ClusterSecurity("nixl-test-secret-0123456789")
L, H, D, BS, NB = 2, 2, 8, 4, 12
LAYOUT = KVLayout("m", "float32", L, H, D, BS)


class Receiver:
    """A decode side without an engine: one pool, its grants, a server, receivers per request."""

    def __init__(self, grants: Grants | None = None):
        self.pool = torch.zeros(L, 2, NB, BS, H, D)
        self.grants = grants or Grants()
        self.receivers: dict[str, WorkerReceiver] = {}
        self.frames: list = []
        self.server = serve(
            "nixl", self.on_frame, kv_caches=[self.pool], grants=self.grants, security=SECURITY
        )

    def on_frame(self, header, payload):
        self.frames.append((header, payload))
        if header.request_id in self.receivers:
            self.receivers[header.request_id].on_frame(header, payload)

    def reserve(self, rid: str, blocks: list[int], num_tokens: int) -> Destination:
        grant = self.grants.issue(rid, blocks)
        self.receivers[rid] = WorkerReceiver(rid, [self.pool], LAYOUT, blocks, 0, num_tokens)
        return Destination(blocks, LAYOUT, grant=grant)

    def stop(self):
        self.server.stop()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.stop()


def chunk(rid: str, layer: int, start: int, end: int):
    header = ChunkHeader(rid, LAYOUT.fingerprint, layer, start, end, 0, H, D, "float32")
    return header, torch.randn(2, end - start, H, D)


def commit(rid: str):
    return ChunkHeader(rid, LAYOUT.fingerprint, kind="commit", first_tokens=(1,))


def send_all(t, dest: Destination, paged: bool = False) -> list:
    """Request r1's 7 tokens, every layer (straight out of a paged pool of the sender's, blocks
    6, 1 and 2 of it, when `paged`), then its commit; returns what each layer sent."""
    sent = []
    pool = torch.randn(L, 2, 8, BS, H, D)  # the sender's own paged pool
    for layer in range(L):
        if paged:
            header, data = read_chunk(pool[layer], LAYOUT, "r1", layer, [6, 1, 2], 0, 7)
            assert t.send_paged(header, pool[layer], [6, 1, 2], dest)
        else:
            header, data = chunk("r1", layer, 0, 7)
            t.send(header, data, dest)
        sent.append(data)
    t.send(commit("r1"), None, dest)
    t.flush(10)
    return sent


def assert_landed(receiver, dest: Destination, sent: list) -> None:
    """Request r1 committed, and each layer's tokens are in its reserved blocks."""
    assert receiver.receivers["r1"].ranks[0].state.name == "DONE"
    for layer, data in enumerate(sent):
        for tok in range(data.shape[1]):
            block = dest.block_ids[tok // BS]
            assert torch.equal(receiver.pool[layer, :, block, tok % BS], data[:, tok])


def test_a_whole_transfer_lands_in_the_reserved_blocks(receiver):
    dest = receiver.reserve("r1", [3, 5], 7)
    t = connect("nixl", receiver.server.address, security=SECURITY)
    try:
        sent = send_all(t, dest)
    finally:
        t.close()
    assert receiver.receivers["r1"].error is None
    assert_landed(receiver, dest, sent)
    others = [b for b in range(NB) if b not in dest.block_ids]
    assert not receiver.pool[:, :, others].any()  # nothing outside the reservation


def test_chunks_sent_from_the_senders_pool_land_with_one_registration(receiver, monkeypatch):
    """send_paged WRITEs each layer straight out of the sender's paged pool, registered once
    (at the first chunk) and deregistered when the transport closes."""
    dest = receiver.reserve("r1", [3, 5], 7)
    t = connect("nixl", receiver.server.address, security=SECURITY)
    registered, deregistered = [], []
    agent = t._agent
    real_reg, real_dereg = agent.register_memory, agent.deregister_memory
    monkeypatch.setattr(
        agent, "register_memory", lambda *a, **k: registered.append(1) or real_reg(*a, **k)
    )
    monkeypatch.setattr(
        agent, "deregister_memory", lambda *a, **k: deregistered.append(1) or real_dereg(*a, **k)
    )
    try:
        sent = send_all(t, dest, paged=True)
    finally:
        t.close()
    assert len(registered) == 1 and len(deregistered) == 1  # the pool, once
    assert_landed(receiver, dest, sent)
    others = [b for b in range(NB) if b not in dest.block_ids]
    assert not receiver.pool[:, :, others].any()  # nothing outside the reservation


def test_paged_chunks_of_other_source_blocks_get_their_own_descriptors(receiver):
    """Descriptors are kept per request and token range: a layer whose tokens lie in other
    blocks of the sender's pool than the last one's is moved from those."""
    dest = receiver.reserve("r1", [3, 5], 7)
    t = connect("nixl", receiver.server.address, security=SECURITY)
    pool = torch.randn(L, 2, 8, BS, H, D)
    sent = []
    try:
        for layer, blocks in enumerate(([6, 1, 2], [0, 4, 7])):
            header, data = read_chunk(pool[layer], LAYOUT, "r1", layer, blocks, 0, 7)
            assert t.send_paged(header, pool[layer], blocks, dest)
            sent.append(data)
        t.send(commit("r1"), None, dest)
        t.flush(10)
    finally:
        t.close()
    assert_landed(receiver, dest, sent)


def test_paged_chunks_go_through_send_where_they_cannot_be_written_directly(receiver):
    """A pool of another dtype than the receiver's is not sent by send_paged (False): the
    caller gathers it and sends as before."""
    dest = receiver.reserve("r1", [3, 5], 7)
    t = connect("nixl", receiver.server.address, security=SECURITY)
    try:
        pool = torch.randn(2, 8, BS, H, D, dtype=torch.bfloat16)
        header = dataclasses.replace(chunk("r1", 0, 0, 7)[0], dtype="bfloat16")
        assert not t.send_paged(header, pool, [6, 1, 2], dest)
        assert not t.send_paged(header, pool.float().transpose(3, 4), [6, 1, 2], dest)
    finally:
        t.close()


def test_in_place_headers_wait_for_the_commit(receiver):
    """A WRITE's in-place header waits until the request's commit carries it (or until
    max_pending_headers of them wait): a control message per layer woke the sender's gRPC
    threads at every layer."""
    dest = receiver.reserve("r1", [3, 5, 7, 9], 15)
    t = connect("nixl", receiver.server.address, security=SECURITY, max_pending_headers=3)

    def layers_heard():
        return [(h.layer, h.start) for h, _ in list(receiver.frames) if h.kind == "kv"]

    try:
        for layer in range(L):
            t.send(*chunk("r1", layer, 0, 7), dest)
        time.sleep(0.3)
        assert layers_heard() == []  # two wait
        t.send(*chunk("r1", 0, 7, 15), dest)  # the third: all three go
        wait_until(lambda: len(layers_heard()) == 3, 10, "three headers")
        t.send(*chunk("r1", 1, 7, 15), dest)
        time.sleep(0.3)
        assert len(layers_heard()) == 3 and receiver.receivers["r1"].ranks[0].state.name != "DONE"
        t.send(commit("r1"), None, dest)  # the last one travels with the commit
        t.flush(10)
    finally:
        t.close()
    assert layers_heard() == [(0, 0), (1, 0), (0, 7), (1, 7)]
    assert all(h.in_place for h, _ in receiver.frames if h.kind == "kv")
    assert receiver.receivers["r1"].ranks[0].state.name == "DONE"


def test_a_forged_grant_is_refused_and_nothing_is_written(receiver):
    dest = receiver.reserve("r1", [3, 5], 7)
    forged = dataclasses.replace(dest, grant="0" * 32)
    t = connect("nixl", receiver.server.address, security=SECURITY)
    try:
        with pytest.raises(PermissionError, match="forged"):
            t.send(*chunk("r1", 0, 0, 7), forged)
    finally:
        t.close()
    assert not receiver.pool.any() and receiver.grants.num_refused == 1


def test_a_claim_outside_the_reservation_is_refused(receiver):
    dest = receiver.reserve("r1", [3, 5], 7)
    t = connect("nixl", receiver.server.address, security=SECURITY)
    try:
        outside = dataclasses.replace(dest, block_ids=[3, 6])  # block 6 is not reserved
        with pytest.raises(PermissionError, match="outside the reservation"):
            t.send(*chunk("r1", 0, 0, 7), outside)
        beyond = dataclasses.replace(dest, block_ids=[3, NB + 1])  # not even in the pool
        with pytest.raises(ValueError, match="outside the receiver's pool"):
            t.send(*chunk("r1", 0, 0, 7), beyond)
    finally:
        t.close()
    assert not receiver.pool.any()


def test_a_replayed_grant_is_refused(receiver):
    """A grant whose reservation ended (here committed) is refused to any sender, and a held one
    (ended while a claim may write) too: nothing more is written."""
    dest = receiver.reserve("r1", [3, 5], 7)
    first = connect("nixl", receiver.server.address, security=SECURITY)
    second = connect("nixl", receiver.server.address, security=SECURITY)
    try:
        first.send(*chunk("r1", 0, 0, 7), dest)
        first.send(commit("r1"), None, dest)
        first.flush(10)
        assert receiver.grants.close("r1", lambda: None)  # the hand-off does so at the commit
        before = receiver.pool.clone()
        with pytest.raises(PermissionError, match="forged, or its reservation is gone"):
            second.send(*chunk("r1", 1, 0, 7), dest)
        held = receiver.reserve("r2", [7, 8], 7)
        first.send(*chunk("r2", 0, 0, 7), held)
        assert not receiver.grants.close("r2", lambda: None)  # aborted mid-claim: held
        before = receiver.pool.clone()
        with pytest.raises(PermissionError, match="has ended"):
            second.send(*chunk("r2", 1, 0, 7), held)
        assert torch.equal(receiver.pool, before)
    finally:
        first.close()
        second.close()


def test_frames_without_the_grant_are_refused(receiver):
    dest = receiver.reserve("r1", [3, 5], 7)
    _, control, _ = parse_address(receiver.server.address)
    raw = GrpcTransport(control, security=SECURITY)
    try:
        header = dataclasses.replace(chunk("r1", 0, 0, 7)[0], in_place=True)
        # a forged grant, then the right grant before any claim: both refused
        raw.send_headers([dataclasses.replace(header, grant="f" * 32)])
        raw.send_headers([dataclasses.replace(header, grant=dest.grant)])
        raw.flush(10)
    finally:
        raw.close()
    refused = [p for _, p in receiver.frames if isinstance(p, RefusedFrame)]
    assert len(refused) == 2
    assert "write grant" in refused[0].reason and "no sender claimed" in refused[1].reason
    assert receiver.receivers["r1"].error is not None  # the request failed, nothing counted


@pytest.mark.parametrize("stranger", [INSECURE, ClusterSecurity("not-the-cluster-secret")])
def test_a_peer_without_the_secret_gets_no_metadata(receiver, stranger):
    with pytest.raises(ConnectionRefusedError):
        connect("nixl", receiver.server.address, security=stranger, timeout=5)
    _, control, _ = parse_address(receiver.server.address)
    channel = stranger.channel(control)
    try:
        with pytest.raises(grpc.RpcError) as e:
            channel.unary_unary(METADATA_METHOD)(b"", timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        channel.close()


def test_past_its_window_a_sender_writes_only_under_a_new_claim():
    """No WRITE of a claim is posted after its window: past it the sender claims again (its
    WRITEs so far ended), which the decode side takes only while the reservation holds. Before,
    the sender failed the request at the window's end, however long its prefill had to run."""
    receiver = Receiver(Grants(window_s=0.3))
    try:
        dest = receiver.reserve("r1", [3, 5], 7)
        t = connect("nixl", receiver.server.address, security=SECURITY)
        try:
            t.send(*chunk("r1", 0, 0, 7), dest)
            first = receiver.grants._grants["r1"].claimed_at
            time.sleep(0.5)
            before = receiver.pool.clone()
            t.send(*chunk("r1", 1, 0, 7), dest)  # a new claim, then the WRITE
            assert receiver.grants._grants["r1"].claimed_at > first
            assert not torch.equal(receiver.pool, before)
            held = []
            assert not receiver.grants.close("r1", lambda: held.append(1))  # ended, claim open
            time.sleep(0.5)
            before = receiver.pool.clone()
            with pytest.raises(PermissionError, match="has ended"):
                t.send(*chunk("r1", 2, 0, 7), dest)
            assert torch.equal(receiver.pool, before)  # refused: nothing written
        finally:
            t.close()
    finally:
        receiver.stop()


def test_a_decode_worker_holds_blocks_a_claim_may_still_write(tiny_models):
    """Reserve, a sender claims and writes one layer, the router aborts the reservation: the
    blocks stay reserved (never handed to another request) until the sender's abort arrives."""
    model_dir = tiny_models("llama-gqa")[0]
    decode = start_decode(
        model_dir, engine=dict(kv_cache_memory=1 << 17, max_model_len=64), kv_backend="nixl"
    )
    channel = grpc.insecure_channel(decode.address)
    stub = worker_pb2_grpc.DecodeWorkerStub(channel)

    def stats():
        return stub.Stats(worker_pb2.StatsRequest(), timeout=10)

    transport = None
    try:
        total = stats().num_total_blocks
        prompt = random_prompts([20], seed=3)[0]
        res = stub.Reserve(
            worker_pb2.ReserveRequest(request_id="held", prompt_token_ids=prompt, sampling=GREEDY),
            timeout=10,
        )
        assert res.endpoint.backend == "nixl" and res.endpoint.write_grant
        layout = dataclasses.replace(decode.layout, block_size=res.block_size)
        dest = Destination(list(res.block_ids), layout, grant=res.endpoint.write_grant)
        transport = connect("nixl", res.endpoint.address)
        heads, dim = layout.num_kv_heads, layout.head_dim
        header = ChunkHeader("held", layout.fingerprint, 0, 0, 20, 0, heads, dim, "float32")
        transport.send(header, torch.randn(2, 20, heads, dim), dest)
        assert stub.Abort(worker_pb2.WorkerAbortRequest(request_id="held"), timeout=10).found
        time.sleep(0.3)  # several lease sweeps: the blocks must stay held
        s = stats()
        assert s.num_reserved == 1 and s.num_free_blocks < total
        transport.send(ChunkHeader("held", layout.fingerprint, kind="abort"), None, dest)
        transport.flush(10)
        wait_until(
            lambda: stats().num_reserved == 0 and stats().num_free_blocks == total,
            5,
            f"held blocks not freed after the sender's abort: {stats()}",
        )
    finally:
        if transport is not None:
            transport.close()
        channel.close()
        decode.stop()
