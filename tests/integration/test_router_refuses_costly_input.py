"""Requests the router refuses before any worker is asked, over gRPC: n copies of a long prompt's
logprobs past the bound (protos/limits.check_prompt_logprobs) and a chat's JSON nested deeper
than Python's json goes are INVALID_ARGUMENT with a message that says what to change, not
UNKNOWN, and the router keeps serving. No worker is registered: a request that passes these
checks is refused UNAVAILABLE (no decode worker) after them."""

from __future__ import annotations

import grpc
import pytest

from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.server import Router, RouterConfig

MAX_MODEL_LEN = 8192
TEMPLATE = "{% for m in messages %}t3 {{ m.content }} t4 {% endfor %}"
DEEP = "[" * 3000 + "]" * 3000


@pytest.fixture(scope="module")
def api(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    router = Router(
        RouterConfig(model=model_dir, max_model_len=MAX_MODEL_LEN, chat_template=TEMPLATE)
    ).start()
    channel = grpc.insecure_channel(router.address)
    yield pdserve_pb2_grpc.PDServeStub(channel)
    channel.close()
    router.stop()


def _status(api, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        list(api.Generate(request, timeout=30))
    return e.value.code(), e.value.details()


def _ids(length: int, **sampling) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=[5] * length),
        sampling=pdserve_pb2.SamplingParams(**sampling),
    )


def _chat(**fields) -> pdserve_pb2.GenerateRequest:
    req = pdserve_pb2.GenerateRequest()
    req.chat.messages.add(role="user", content="t7")
    for name, value in fields.items():
        setattr(req.chat, name, value)
    return req


def test_n_copies_of_a_long_prompts_logprobs_are_invalid_argument(api):
    code, said = _status(api, _ids(MAX_MODEL_LEN - 1, n=64, prompt_logprobs=20))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "lower n or prompt_logprobs, or shorten the prompt" in said
    # one sequence of the same prompt passes the check (then finds no worker)
    code, _ = _status(api, _ids(MAX_MODEL_LEN - 1, n=1, prompt_logprobs=20))
    assert code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    "field, says",
    [
        ("chat_template_kwargs_json", "chat.chat_template_kwargs_json nests JSON too deeply"),
        ("tools_json", "chat.tools_json nests JSON too deeply"),
    ],
)
def test_deeply_nested_chat_json_is_invalid_argument(api, field, says):
    code, said = _status(api, _chat(**{field: DEEP}))
    assert (code, said[: len(says)]) == (grpc.StatusCode.INVALID_ARGUMENT, says)
    assert _status(api, _chat())[0] == grpc.StatusCode.UNAVAILABLE  # still serving
