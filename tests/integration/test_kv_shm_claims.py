"""The shm backend's write claims (kvtransfer/backends/claims.py, shm_backend.py): a sender claims
a reservation before it copies into the decode side's pool, so a reservation that ends while a
copy may still land is held until the sender's last word. Over a real control server: a claim
with a wrong grant, or of a reservation that ended, is refused before anything is written; an
in-place frame nobody claimed is refused; an ended reservation stays held while its claim is
open and is let go by the sender's abort; a claim names this process; a sender claims again as
its window nears its end; a pipelined stage's claim ends with its release (and a nixl sender claims again too); through the workers,
a Prefill into a reservation that ended is refused before the engine runs."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from helpers.kv import TOKEN_RANGES, DecodeSide, push_request, source_cache, src_layout
from helpers.models import random_prompts
from helpers.threads import wait_until
from helpers.worker import GREEDY, RPC_TIMEOUT, BackendCluster, idle, used_backends
from pdserve.kvtransfer import ChunkHeader
from pdserve.kvtransfer.backends import claims, connect
from pdserve.kvtransfer.backends.grpc_sender import GrpcTransport
from pdserve.kvtransfer.backends.nixl_backend import nixl_available
from pdserve.kvtransfer.backends.shm_backend import locality, parse_address
from pdserve.kvtransfer.reshard import read_chunk
from pdserve.kvtransfer.transport import Destination, PipelineStage
from pdserve.protos.pdserve.v1 import worker_pb2


@pytest.fixture
def side():
    s = DecodeSide("shm")
    yield s
    s.close()


def first_chunk(request_id: str, seed: int = 1):
    layout = src_layout()
    start, end = TOKEN_RANGES[0]
    return read_chunk(source_cache(seed)[0], layout, request_id, 0, [11, 3, 7, 0, 9], start, end)


def test_a_claimed_hand_off_lands_and_its_claim_names_this_process(side):
    dest = side.reserve("r1", [5, 1, 2])
    tx = connect("shm", side.server.address)
    try:
        sent = push_request(tx, "r1", 7, dest)
        side.assert_received("r1", 7)
        assert all(h.grant == dest.grant for h in side.frames)
        assert len(side.frames) == len(sent)
        grant = side.grants._grants["r1"]
        assert list(grant.claimants.values()) == [claims.process_identity()]
        # the commit was the sender's last word: ending the reservation holds nothing
        assert side.grants.close("r1", lambda: None) is True
    finally:
        tx.close()


def test_a_wrong_grant_or_an_ended_reservation_is_refused_before_any_write(side):
    dest = side.reserve("r2", [4, 6])
    before = side.cache.clone()
    tx = connect("shm", side.server.address)
    try:
        header, data = first_chunk("r2")
        forged = Destination(dest.block_ids, dest.layout, grant="0" * 32)
        with pytest.raises(PermissionError, match="holds this write grant"):
            tx.send(header, data, forged)
        assert side.grants.close("r2", lambda: None) is True  # nobody claimed: free at once
        with pytest.raises(PermissionError):  # a replay of the right grant, now ended
            tx.send(header, data, dest)
        assert torch.equal(side.cache, before)  # nothing was written
    finally:
        tx.close()


def test_an_in_place_frame_nobody_claimed_is_refused(side):
    dest = side.reserve("r3", [2])
    _, _, _, control = parse_address(side.server.address)
    raw = GrpcTransport(control)
    try:
        header = ChunkHeader(
            "r3", side.layout.fingerprint, 0, 0, 8, 0, 2, 8, "float32", in_place=True,
            grant=dest.grant,
        )  # fmt: skip
        raw.send_headers([header])
        raw.flush(5)
        rx = side.wait_finished("r3")
        assert rx.error and "no sender claimed" in rx.error
    finally:
        raw.close()


def test_an_ended_reservation_is_held_until_the_senders_abort(side):
    dest = side.reserve("r4", [3, 7])
    tx = connect("shm", side.server.address)
    released = []
    try:
        header, data = first_chunk("r4")
        tx.send(header, data, dest)  # claimed, written
        assert side.grants.close("r4", lambda: released.append("r4")) is False  # held
        assert side.grants.num_held == 1 and released == []
        tx.send(ChunkHeader("r4", header.fingerprint, kind="abort"), None, dest)
        tx.flush(5)
        assert released == ["r4"] and side.grants.num_held == 0
    finally:
        tx.close()


@pytest.mark.parametrize("backend", ["shm", "nixl"])
def test_a_sender_claims_again_as_its_window_nears_its_end(backend):
    # nixl too: before, a prefill that outlasted the window (60 s) failed at its next chunk
    if backend == "nixl" and not nixl_available():
        pytest.skip("NIXL is not installed: pip install 'pdserve[nixl]'")
    side = DecodeSide(backend)
    side.grants.window_s = 0.4
    tx = connect(backend, side.server.address)
    try:
        dest = side.reserve("r5", [0, 1])
        header, data = first_chunk("r5")
        tx.send(header, data, dest)
        first = side.grants._grants["r5"].claimed_at
        tx.send(header, data, dest)  # well inside the window: no new claim
        assert side.grants._grants["r5"].claimed_at == first
        time.sleep(0.35)  # less than a quarter of the window left
        tx.send(header, data, dest)
        assert side.grants._grants["r5"].claimed_at > first
        time.sleep(0.5)  # the first window is over: the second claim's still holds
        tx.send(header, data, dest)
        tx.send(ChunkHeader("r5", header.fingerprint, kind="abort"), None, dest)
        tx.flush(5)
    finally:
        tx.close()
        side.close()


def test_a_pipelined_stages_claim_ends_with_its_release(side):
    dest = side.reserve("r6", [1, 2])
    stage = PipelineStage("s" * 32, 1, 2, (1, 3), 0)
    tx = connect("shm", side.server.address)
    released = []
    try:
        layout = src_layout()
        src = source_cache(3)
        start, end = TOKEN_RANGES[0]
        header, data = read_chunk(src[1], layout, "r6", 1, [11, 3, 7, 0, 9], start, end)
        staged = Destination(dest.block_ids, dest.layout, grant=dest.grant, stage=stage)
        tx.send(header, data, staged)
        grant = side.grants._grants["r6"]
        assert list(grant.stages.values()) == [stage]
        assert side.grants.close("r6", lambda: released.append("r6")) is False  # mid-step
        tx.flush(5)
        tx.release("r6")
        assert released == ["r6"]
        with pytest.raises(PermissionError):  # its next step's claim: the reservation ended
            tx.send(header, data, staged)
    finally:
        tx.close()


def test_a_release_without_the_grant_is_refused(side):
    side.reserve("r7", [2])
    _, _, _, control = parse_address(side.server.address)
    raw = GrpcTransport(control)
    try:
        with pytest.raises(ConnectionError, match="PERMISSION_DENIED.*without its reservation"):
            claims.tell_released(raw, "r7", "f" * 32, "someone", "s" * 32, 5)
    finally:
        raw.close()


def test_a_prefill_into_a_reservation_that_ended_is_refused_before_it_computes(tiny_models):
    """Through the workers: the prefill worker claims on its call's thread before the engine
    runs (prefill_worker/service.py `_claim`), so a reservation that ended is refused there
    (ABORTED, naming why), nothing is computed, and the worker serves the next request."""
    cluster = BackendCluster(tiny_models("llama-gqa")[0], "shm", 1, 1)
    try:
        prompt = random_prompts([21], seed=6)[0]
        reservation = cluster.reserve("ended", prompt)
        assert reservation.endpoint.backend == "shm" and reservation.endpoint.write_grant
        # the named endpoint says where its pool is, as an offer does (kvtransfer/choose.py)
        assert reservation.endpoint.locality == locality(reservation.endpoint.address) != ""
        abort = worker_pb2.WorkerAbortRequest(request_id="ended")
        assert cluster.d.Abort(abort, timeout=RPC_TIMEOUT).found
        engine = cluster.prefill.loop.engine
        steps = len(engine.step_trace)
        with pytest.raises(grpc.RpcError) as err:
            cluster.prefill_req("ended", prompt, reservation)
        assert err.value.code() == grpc.StatusCode.ABORTED, err.value.details()
        assert "refused the KV write" in err.value.details()
        assert "its reservation is gone" in err.value.details()
        assert len(engine.step_trace) == steps  # nothing computed
        assert len(cluster.generate("next", prompt)) == GREEDY.max_tokens
        assert used_backends(cluster) == {"shm"}
        wait_until(lambda: idle(cluster), 5, f"decode pool not back to idle: {cluster.stats()}")
    finally:
        cluster.stop()
