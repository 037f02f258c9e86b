"""The transport backends end to end: engine-shaped KV chunks from a sender, through a real channel,
into a KVReceiver on the decode side (different block sizes on the two sides). What needs no
channel: tests/unit/test_kv_backends.py."""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
import time

import pytest

from helpers.kv import (
    CONNECT_TIMEOUT,
    SRC_BLOCK_IDS,
    TIMEOUT,
    DecodeSide,
    push_request,
    source_cache,
    src_layout,
)
from pdserve.kvtransfer import ChunkHeader, LayoutMismatch, TransferState
from pdserve.kvtransfer.backends import BACKENDS, connect, serve
from pdserve.kvtransfer.reshard import read_chunk
from pdserve.kvtransfer.transport import Destination


def sender_process(
    backend: str, address: str, request_id: str, seed: int, dest: Destination
) -> None:
    """The body of a spawned prefill process."""
    tx = connect(backend, address, timeout=CONNECT_TIMEOUT)
    try:
        push_request(tx, request_id, seed, dest)
        tx.flush(TIMEOUT)
    finally:
        tx.close()


def dying_sender_process(backend: str, address: str, request_id: str, dest: Destination) -> None:
    """A prefill process that dies mid-request, without closing its channel."""
    import os

    tx = connect(backend, address, timeout=CONNECT_TIMEOUT)
    header, data = read_chunk(
        source_cache(10)[0], src_layout(), request_id, 0, SRC_BLOCK_IDS, 0, 20
    )
    tx.send(header, data, dest)
    tx.flush(TIMEOUT)
    os._exit(3)


# cuda_ipc writes into a CUDA pool of another process: tests/gpu/test_cuda_ipc_handoff.py
HOST_BACKENDS = tuple(b for b in BACKENDS if b != "cuda_ipc")


@pytest.fixture(params=HOST_BACKENDS)
def decode(request):
    side = DecodeSide(request.param)
    yield side
    side.close()


def test_frames_arrive_in_order_and_fill_the_cache(decode):
    dest = decode.reserve("r1", [5, 1, 6])
    tx = connect(decode.backend, decode.server.address, timeout=TIMEOUT)
    try:
        sent = push_request(tx, "r1", seed=1, dest=dest)
        tx.flush(TIMEOUT)
        decode.assert_received("r1", seed=1)
    finally:
        tx.close()
    assert [dataclasses.replace(h, in_place=False, grant="") for h in decode.frames] == sent
    in_place = decode.backend in ("shm", "nixl")  # the sender wrote the KV into the pool
    assert all(h.in_place == (in_place and h.kind == "kv") for h in decode.frames)
    assert decode.receivers["r1"].bytes_received == sum(
        2 * (h.end - h.start) * 2 * 8 * 4 for h in sent if h.kind == "kv"
    )


def test_sender_in_another_process(decode):
    dest = decode.reserve("r-proc", [7, 0, 2])
    proc = multiprocessing.get_context("spawn").Process(
        target=sender_process, args=(decode.backend, decode.server.address, "r-proc", 2, dest)
    )
    proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        proc.join()
    assert proc.exitcode == 0
    decode.assert_received("r-proc", seed=2)


def test_a_dead_sender_leaves_the_other_channels_working(decode):
    dead_dest, good_dest = decode.reserve("dead", [0, 1, 2]), decode.reserve("good", [5, 6, 7])
    tx = connect(decode.backend, decode.server.address, timeout=TIMEOUT)
    try:
        proc = multiprocessing.get_context("spawn").Process(
            target=dying_sender_process,
            args=(decode.backend, decode.server.address, "dead", dead_dest),
        )
        proc.start()
        proc.join(60)
        assert proc.exitcode == 3
        push_request(tx, "good", seed=11, dest=good_dest)
        tx.flush(TIMEOUT)
        decode.assert_received("good", seed=11)
    finally:
        tx.close()
    # its request stays unfinished (the decode worker's lease frees it), nothing hangs
    assert decode.receivers["dead"].state in (TransferState.PENDING, TransferState.TRANSFERRING)


def test_two_senders_to_one_server(decode):
    dests = {"a": decode.reserve("a", [0, 1, 2]), "b": decode.reserve("b", [5, 6, 7])}
    errors = []

    def prefill(request_id, seed):
        try:
            tx = connect(decode.backend, decode.server.address, timeout=TIMEOUT)
            try:
                push_request(tx, request_id, seed, dests[request_id])
                tx.flush(TIMEOUT)
            finally:
                tx.close()
        except Exception as e:
            errors.append(e)

    threads = [
        threading.Thread(target=prefill, args=(rid, seed)) for rid, seed in (("a", 3), ("b", 4))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    decode.assert_received("a", seed=3)
    decode.assert_received("b", seed=4)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_many_senders_of_one_process_at_once(backend):
    """Eight channels of one prefill process, each on a thread of its own, push a request at the
    same moment, five times over: a process's channels share what the backend keeps per process
    (nixl: one sending agent, whose UCX worker hung the writes and then crashed the process when
    threads used it at once). The channels are opened first, one by one: it is the sends that
    run together here (two channels opening at once: test_two_senders_to_one_server)."""
    senders, rounds = 8, 5
    side = DecodeSide(backend, num_blocks=3 * senders)
    channels = []
    try:
        for _ in range(senders):
            channels.append(connect(backend, side.server.address, timeout=CONNECT_TIMEOUT))
        for r in range(rounds):
            ids = [f"r{r}-{i}" for i in range(senders)]
            dests = [side.reserve(rid, [3 * i, 3 * i + 1, 3 * i + 2]) for i, rid in enumerate(ids)]
            start, errors = threading.Barrier(senders), []

            def prefill(i, ids=ids, dests=dests, start=start, errors=errors):
                try:
                    start.wait(TIMEOUT)
                    push_request(channels[i], ids[i], i, dests[i])
                    channels[i].flush(TIMEOUT)
                except Exception as e:
                    errors.append(e)

            threads = [threading.Thread(target=prefill, args=(i,)) for i in range(senders)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(2 * TIMEOUT)
            assert not errors, errors
            for i, rid in enumerate(ids):
                side.assert_received(rid, seed=i)
    finally:
        for tx in channels:
            tx.close()
        side.close()


def test_sender_whose_server_is_gone_fails_fast(decode):
    dest = decode.reserve("r1", [5, 1, 6])
    tx = connect(decode.backend, decode.server.address, timeout=TIMEOUT)
    try:
        header, data = read_chunk(source_cache(5)[0], src_layout(), "r1", 0, SRC_BLOCK_IDS, 0, 20)
        tx.send(header, data, dest)
        tx.flush(TIMEOUT)
        address = decode.server.address
        decode.server.stop()
        t0 = time.monotonic()
        with pytest.raises((ConnectionError, TimeoutError)):
            for _ in range(100):
                tx.send(header, data, dest)
                tx.flush(2.0)
                time.sleep(0.01)
        assert time.monotonic() - t0 < 5.0
    finally:
        tx.close()
    if (
        decode.backend != "shm"
    ):  # (shm maps the pool, which is still there; its control channel is not)
        t0 = time.monotonic()
        with pytest.raises(ConnectionError):
            connect(decode.backend, address, timeout=1.0)
        assert time.monotonic() - t0 < 5.0


def test_a_bad_frame_fails_only_its_request(decode):
    bad, good = decode.reserve("bad", [0, 1, 2]), decode.reserve("good", [5, 6, 7])
    tx = connect(decode.backend, decode.server.address, timeout=TIMEOUT)
    try:
        # a frame for a request this rank never reserved: the handler raises, the channel goes on
        ghost = ChunkHeader("ghost", src_layout().fingerprint, kind="commit", first_tokens=(0,))
        tx.send(ghost, None, bad)
        if (
            decode.backend == "shm"
        ):  # the sender writes in place, so it refuses (and aborts the request)
            with pytest.raises(LayoutMismatch, match="same model"):
                push_request(tx, "bad", seed=6, dest=bad, model="another-model")
        else:
            push_request(tx, "bad", seed=6, dest=bad, model="another-model")
        push_request(tx, "good", seed=7, dest=good)
        tx.flush(TIMEOUT)
        decode.assert_received("good", seed=7)
    finally:
        tx.close()
    rx = decode.wait_finished("bad")
    assert rx.state == TransferState.FAILED
    assert ("aborted" if decode.backend == "shm" else "same model") in rx.error


def test_a_long_header_travels_whole(decode):
    """The longest request id (256 characters, 2 bytes each in UTF-8) makes a header too long for
    the torch backend's envelope: it goes as its own message."""
    rid = "é" * 256
    dest = decode.reserve(rid, [5, 1, 6])
    tx = connect(decode.backend, decode.server.address, timeout=TIMEOUT)
    try:
        push_request(tx, rid, seed=8, dest=dest)
        tx.flush(TIMEOUT)
        decode.assert_received(rid, seed=8)
    finally:
        tx.close()


def test_grpc_server_can_run_the_handler_on_a_worker_thread():
    side = DecodeSide("grpc", max_backlog_bytes=1 << 20)
    try:
        dest = side.reserve("r1", [2, 3, 4])
        tx = connect("grpc", side.server.address, timeout=TIMEOUT)
        try:
            push_request(tx, "r1", seed=9, dest=dest)
            tx.flush(TIMEOUT)
            side.assert_received("r1", seed=9)
        finally:
            tx.close()
    finally:
        side.close()


def test_concurrent_flushes_share_one_flush_call_within_the_servers_rpc_limit():
    """Many requests flushing one channel at once (a prefill worker finishing a batch of prompts)
    ask the server with one Flush call at a time: the server admits 2 * max_channels + 2 calls,
    and each extra Flush used to be refused (RESOURCE_EXHAUSTED) and failed its request."""
    handled = []

    def slow_handler(header, payload):  # keeps the flushes waiting on the server together
        time.sleep(0.02)
        handled.append(header.request_id)

    server = serve("grpc", slow_handler, max_channels=1)  # at most 4 calls at once
    tx = connect("grpc", server.address, timeout=TIMEOUT)
    errors = []

    def one(i: int) -> None:
        try:
            tx.send_headers([ChunkHeader(f"r{i}", "fp", kind="abort")])
            tx.flush(TIMEOUT)
        except Exception as e:  # the test reports every failure
            errors.append(repr(e))

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * TIMEOUT)
        assert errors == []
        assert sorted(handled) == sorted(f"r{i}" for i in range(12))
    finally:
        tx.close()
        server.stop()
