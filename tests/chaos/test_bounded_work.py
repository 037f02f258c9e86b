"""Must-show (c) at CI scale (benchmarks/robustness/chaos.py measures the router's CPU and the other client's
TTFT): a prompt far past what max_model_len can hold and a huge stop list are refused before the
router tokenizes or scans anything, with statuses that say what to change, while another client
keeps being served."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from helpers.chaos import RPC_TIMEOUT, SecureCluster, stream
from pdserve.protos.pdserve.v1 import pdserve_pb2

SAMPLING = pdserve_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    c = SecureCluster(model_dir)
    yield c
    c.stop()


def _expect(cluster, request, code, says):
    with pytest.raises(grpc.RpcError) as err:
        list(cluster.api.Generate(request, timeout=RPC_TIMEOUT))
    assert err.value.code() == code, err.value.details()
    assert says in err.value.details()


def test_oversized_prompt_and_stop_list_are_refused_beside_a_normal_client(cluster):
    # one word of the tiny vocabulary per token: 60 MB is ~20 million tokens for max_model_len 256.
    # Past the largest request a valid client can send (router.server.max_request_bytes), gRPC
    # refuses the message before the router reads it whole; below that, the router counts bytes
    # before it tokenizes anything
    huge_text = pdserve_pb2.GenerateRequest(text="t5 " * (20 << 20), sampling=SAMPLING)
    long_text = pdserve_pb2.GenerateRequest(text="t5 " * (1 << 18), sampling=SAMPLING)
    huge_chat = pdserve_pb2.GenerateRequest(
        chat=pdserve_pb2.ChatMessages(
            messages=[pdserve_pb2.ChatMessage(role="user", content="t7 " * (4 << 20))]
        ),
        sampling=SAMPLING,
    )
    long_chat = pdserve_pb2.GenerateRequest(
        chat=pdserve_pb2.ChatMessages(
            messages=[pdserve_pb2.ChatMessage(role="user", content="t7 " * (1 << 10))] * 256
        ),
        sampling=SAMPLING,
    )
    stops = pdserve_pb2.SamplingParams(temperature=0, max_tokens=8)
    stops.stop.extend(["s"] * 1_000_000)
    huge_stops = pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=[3, 4, 5]), sampling=stops
    )
    with futures.ThreadPoolExecutor(4) as pool:
        normal = [pool.submit(stream, cluster.api, [2, 3, 4, 5, 6], SAMPLING) for _ in range(4)]
        _expect(cluster, huge_text, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")
        _expect(cluster, huge_chat, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")
        _expect(
            cluster, long_text, grpc.StatusCode.OUT_OF_RANGE, "the text has at least 786432 bytes"
        )
        _expect(cluster, long_chat, grpc.StatusCode.OUT_OF_RANGE, "the chat has at least")
        _expect(
            cluster,
            huge_stops,
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.stop has 1000000 strings",
        )
        results = [f.result(timeout=RPC_TIMEOUT) for f in normal]
    assert all(how == "finished" and len(ids) == 8 for ids, _, how in results)


def test_a_multibyte_text_is_measured_in_bytes(cluster):
    limit = cluster.router.servicer.encoder.max_prompt_bytes
    fits_in_chars = "\u00e9" * (
        limit // 2 + 1
    )  # 2 bytes each: fewer chars than the limit, more bytes
    _expect(
        cluster,
        pdserve_pb2.GenerateRequest(text=fits_in_chars, sampling=SAMPLING),
        grpc.StatusCode.OUT_OF_RANGE,
        f"the text has {2 * (limit // 2 + 1)} bytes",
    )


def test_a_text_prompt_that_fits_is_still_served(cluster):
    ids, finish, how = stream(cluster.api, [2, 3], SAMPLING)
    assert how == "finished"
    responses = list(
        cluster.api.Generate(
            pdserve_pb2.GenerateRequest(text="t5 t6 t7", sampling=SAMPLING), timeout=RPC_TIMEOUT
        )
    )
    assert responses[-1].finish.usage.prompt_tokens >= 3
