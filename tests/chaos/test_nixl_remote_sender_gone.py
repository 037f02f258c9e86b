"""A nixl sender on "another host" dies mid-transfer (issue 50 follow-up): a prefill process that
claims a reservation, writes two layers and goes silent, whose process the decode worker cannot
prove gone (its claim names no process, as a claim from another host cannot be checked here).
Its aborted reservation stays held (never handed to another request) and, past the claim's
bound, the worker reports itself unhealthy; once the process dies its control connection closes
from its side, and the held blocks are freed and the worker is healthy again without a restart.
Skipped where NIXL is not installed. The Grants logic alone: tests/unit/test_nixl_peer_gone.py."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os

import grpc
import pytest
import torch

from helpers.chaos import wait_until
from helpers.models import random_prompts
from helpers.worker import GREEDY, start_decode
from pdserve.kvtransfer.backends.nixl_backend import nixl_available
from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed: pip install 'pdserve[nixl]'"
)


def remote_sender(address: str, grant: str, block_ids: list, layout, ready, die) -> None:
    """Claims without a process identity (a sender on another host), writes two layers, goes
    silent, and exits when told (its kernel closes its connections)."""
    from pdserve.kvtransfer.backends import connect, nixl_backend
    from pdserve.kvtransfer.transport import Destination
    from pdserve.kvtransfer.wire import ChunkHeader

    nixl_backend.process_identity = dict  # {}: nothing the decode side can prove
    tx = connect("nixl", address)
    dest = Destination(block_ids, layout, grant=grant)
    heads, dim = layout.num_kv_heads, layout.head_dim
    for layer in range(2):
        header = ChunkHeader("far", layout.fingerprint, layer, 0, 20, 0, heads, dim, "float32")
        tx.send(header, torch.randn(2, 20, heads, dim), dest)
    ready.set()
    die.wait(120)
    os._exit(3)


def test_a_dead_remote_senders_hold_ends_once_its_connection_closes(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    decode = start_decode(
        model_dir,
        engine=dict(kv_cache_memory=1 << 17, max_model_len=64),
        kv_backend="nixl",
        kv_options={"grants": {"window_s": 0.5, "xfer_timeout_s": 0.5}},  # a bound of 6 s
        lease_ms=60_000,  # the sender process may take a while to start on a loaded machine
    )
    channel = grpc.insecure_channel(decode.address)
    stub = worker_pb2_grpc.DecodeWorkerStub(channel)

    def stats():
        return stub.Stats(worker_pb2.StatsRequest(), timeout=10)

    def unhealthy() -> str:
        try:
            stats()
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            return e.details()
        return ""

    ctx = multiprocessing.get_context("spawn")
    ready, die = ctx.Event(), ctx.Event()
    try:
        total = stats().num_total_blocks
        res = stub.Reserve(
            worker_pb2.ReserveRequest(
                request_id="far", prompt_token_ids=random_prompts([20], seed=5)[0],
                sampling=GREEDY,
            ),
            timeout=10,
        )  # fmt: skip
        layout = dataclasses.replace(decode.layout, block_size=res.block_size)
        args = (
            res.endpoint.address,
            res.endpoint.write_grant,
            list(res.block_ids),
            layout,
            ready,
            die,
        )
        proc = ctx.Process(target=remote_sender, args=args)
        proc.start()
        assert ready.wait(60), "the sender never wrote"
        assert stub.Abort(worker_pb2.WorkerAbortRequest(request_id="far"), timeout=10).found
        grants = decode.handoff.grants
        wait_until(unhealthy, 60, "the worker never reported the stuck hold")
        assert "'far'" in unhealthy() and decode.handoff.num_held == 1  # held, not handed out
        assert decode.handoff.loop.load()["num_free_blocks"] < total
        die.set()  # the process ends: its kernel closes its connection to the control server
        proc.join(30)
        assert proc.exitcode == 3
        wait_until(lambda: not unhealthy(), 60, "the worker stayed unhealthy")
        s = stats()
        assert s.num_reserved == 0 and s.num_free_blocks == total
        # freed by its closed connection, not by a proof about its process
        assert grants.num_released_peer_gone == 1 and grants.num_released_sender_gone == 0
    finally:
        die.set()
        channel.close()
        decode.stop()
