"""A prompt plus max_tokens past max_model_len, through a real router and workers over 127.0.0.1:
refused over gRPC (OUT_OF_RANGE) and HTTP (400, context_length_exceeded) with vLLM's message
and before any worker work; what fits exactly, an unset max_tokens near the end of the context
and a chat without max_tokens still run; and each worker refuses such a request itself. The
rules alone: tests/unit/test_context_length.py. The cluster is helpers/http.py's
(MAX_MODEL_LEN 256)."""

from __future__ import annotations

import json

import grpc
import pytest

from helpers.http import (
    CHAT,
    MAX_MODEL_LEN,
    MODEL,
    TIMEOUT,
    C,
    assert_error,
    post,
    serves,
)
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2

PROMPT = [5 + i % 5 for i in range(200)]  # 200 tokens: 56 left in the context
# 200 tokens too, once the chat template adds its three ("t3 ... t4 t7", helpers/http.py)
MESSAGES = [{"role": "user", "content": " ".join(f"t{t}" for t in PROMPT[:197])}]


@pytest.fixture
def legs_started(router, monkeypatch):
    """How many legs the router started on the workers (a Reserve is the first worker call)."""
    started = []
    real = router.servicer.legs.start
    monkeypatch.setattr(
        router.servicer.legs, "start", lambda *a, **k: started.append(1) or real(*a, **k)
    )
    return started


def generate(router_, sampling, **input_):
    with grpc.insecure_channel(router_.address) as channel:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        responses = list(
            stub.Generate(pdserve_pb2.GenerateRequest(sampling=sampling, **input_), timeout=TIMEOUT)
        )
    tokens = [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]
    return tokens, responses[-1].finish


def test_grpc_refuses_a_completion_past_the_context_before_any_worker_work(
    router, idle, legs_started
):
    ids = pdserve_pb2.TokenIds(ids=PROMPT)
    for n in (1, 3):  # n sequences have a context each: the count is per sequence
        with pytest.raises(grpc.RpcError) as err:
            generate(router, pdserve_pb2.SamplingParams(max_tokens=57, n=n), token_ids=ids)
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert err.value.details().startswith(
            "This model's maximum context length is 256 tokens. However, you requested 257 "
            "tokens (200 in the prompt, 57 in the completion)."
        ), err.value.details()
        assert "max_tokens can be at most 56" in err.value.details()
    assert legs_started == []
    tokens, finish = generate(
        router,
        pdserve_pb2.SamplingParams(max_tokens=56, temperature=0, ignore_eos=True),
        token_ids=ids,
    )
    assert len(tokens) == 56 and finish.finish_reason == "length"  # exactly the context
    assert legs_started == [1]


def test_grpc_unset_max_tokens_still_runs_to_the_end_of_the_context(router, idle):
    prompt = PROMPT + PROMPT[: MAX_MODEL_LEN - len(PROMPT) - 5]  # 5 positions left (< 16)
    sampling = pdserve_pb2.SamplingParams(temperature=0, ignore_eos=True)
    tokens, finish = generate(router, sampling, token_ids=pdserve_pb2.TokenIds(ids=prompt))
    assert len(tokens) == 5 and finish.finish_reason == "length"


def test_http_refuses_it_with_400_context_length_exceeded_and_vllms_message(
    router, idle, legs_started
):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 57}
    status, _, got = post(router, C, body)
    err = assert_error(status, got, 400)
    assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
    assert "you requested 257 tokens (200 in the prompt, 57 in the completion)" in err["message"]
    chat = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": MAX_MODEL_LEN - 1,
    }
    status, _, got = post(router, CHAT, chat)
    err = assert_error(status, got, 400)
    assert err["code"] == "context_length_exceeded"
    assert "(200 in the messages, 255 in the completion)" in err["message"], err["message"]
    assert legs_started == []
    serves(router)


def test_http_chat_without_max_tokens_runs_until_the_context_is_full(router, idle):
    chat = {
        "model": MODEL,
        "messages": MESSAGES,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, _, got = post(router, CHAT, chat)
    assert status == 200, got
    usage = json.loads(got)["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (200, 56), usage
    assert json.loads(got)["choices"][0]["finish_reason"] == "length"


def test_each_worker_refuses_it_too(workers, idle):
    sampling = pdserve_pb2.SamplingParams(max_tokens=57)
    calls = (
        (
            workers.d.Reserve,
            worker_pb2.ReserveRequest(request_id="x", prompt_token_ids=PROMPT, sampling=sampling),
        ),
        (
            workers.p.Prefill,
            worker_pb2.PrefillRequest(request_id="y", prompt_token_ids=PROMPT, sampling=sampling),
        ),
    )
    for rpc, request in calls:
        with pytest.raises(grpc.RpcError) as err:
            rpc(request, timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "(200 in the prompt, 57 in the completion)" in err.value.details()
