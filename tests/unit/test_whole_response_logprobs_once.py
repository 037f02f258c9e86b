"""A whole completion's prompt logprobs (router/openai/responses/whole.py) are built once per
prompt, however many choices (n) share it, and are the same for every choice; the router may
carry them on every sequence's Finish or on one only. A whole response large enough to stall the
event loop (router/openai/generate.py is_large) is built and serialized on a thread of its own,
a small one on the loop: on FastAPI's test client with a fake router. The shapes themselves:
tests/unit/test_http_logprobs.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from helpers.http_front import FakeRouter
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai import generate
from pdserve.router.openai.app import build_app
from pdserve.router.openai.protocol import CompletionRequest
from pdserve.router.openai.responses import whole
from pdserve.router.openai.responses.logprobs import TokenText
from pdserve.router.openai.server import HttpSettings

TOP = pdserve_pb2.TopLogprobs


class _Words:
    """A tokenizer whose token i reads "w{i} "."""

    all_special_tokens = []
    chat_template = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"w{i} " for i in ids)

    def __len__(self):
        return 10


TEXT = TokenText(_Words())


def _finish(index: int, with_prompt: bool = True) -> pdserve_pb2.Finish:
    finish = pdserve_pb2.Finish(index=index, finish_reason="length")
    finish.usage.prompt_tokens, finish.usage.completion_tokens = 3, 1
    if with_prompt:
        finish.prompt_token_ids.extend([4, 5, 6])
        finish.prompt_logprobs.extend([-2.0, -0.25])
        finish.prompt_top_logprobs.extend(
            [
                TOP(token_ids=[1, 2], logprobs=[-0.1, -0.2]),
                TOP(token_ids=[6, 1], logprobs=[-0.25, -3.0]),
            ]
        )
    return finish


def _responses(choices: int, prompt_on_first_only: bool = False, tokens: int = 1) -> list:
    out = []
    for i in range(choices):
        delta = pdserve_pb2.TokenDelta(
            index=i,
            token_ids=[8] * tokens,
            text="w8 " * tokens,
            logprobs=[-0.5] * tokens,
            top_logprobs=[TOP(token_ids=[8, 3], logprobs=[-0.5, -1.0])] * tokens,
        )
        out.append(pdserve_pb2.GenerateResponse(delta=delta))
    for i in range(choices):
        with_prompt = not prompt_on_first_only or i % 4 == 0
        out.append(pdserve_pb2.GenerateResponse(finish=_finish(i, with_prompt)))
    return out


def _counting(monkeypatch) -> dict:
    calls = {"echo": 0, "field": 0}

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)

        return wrapper

    monkeypatch.setattr(whole, "echo_logprobs", counted("echo", whole.echo_logprobs))
    monkeypatch.setattr(
        whole, "prompt_logprobs_field", counted("field", whole.prompt_logprobs_field)
    )
    return calls


@pytest.mark.parametrize("prompt_on_first_only", [False, True])
def test_prompt_logprobs_are_built_once_per_prompt(monkeypatch, prompt_on_first_only):
    calls = _counting(monkeypatch)
    body = CompletionRequest.model_validate(
        {
            "prompt": [[4, 5, 6], [4, 5, 6]],
            "n": 4,
            "echo": True,
            "logprobs": 1,
            "prompt_logprobs": 1,
        }
    )
    out = whole.whole_response(
        _responses(8, prompt_on_first_only), body, False, "m", "http-x", TEXT
    )
    assert calls == {"echo": 2, "field": 2}  # two prompts, eight choices
    choices = out["choices"]
    assert len(choices) == 8
    for c in choices:  # every choice has its prompt's, as each built its own before
        assert c["text"] == "w4 w5 w6 w8 "
        assert c["logprobs"]["token_logprobs"] == [None, -2.0, -0.25, -0.5]
        assert c["logprobs"]["top_logprobs"][1] == {"w1 ": pytest.approx(-0.1), "w5 ": -2.0}
        assert c["logprobs"]["text_offset"] == [0, 3, 6, 9]
        assert c["prompt_logprobs"] == choices[0]["prompt_logprobs"]
    assert choices[0]["prompt_logprobs"][2] == {
        "6": {"logprob": -0.25, "rank": 1, "decoded_token": "w6 "}
    }


@pytest.mark.parametrize(
    "tokens, body, off_loop",
    [
        (2, {}, False),
        (2, {"logprobs": 1}, False),
        (generate.WHOLE_ON_LOOP_TOKENS + 1, {}, True),
        (generate.WHOLE_ON_LOOP_TOKENS // 2 + 1, {"logprobs": 1}, True),  # x2: one alternative each
    ],
)
def test_a_large_whole_response_is_built_off_the_event_loop(monkeypatch, tokens, body, off_loop):
    threads = []
    real = generate.whole_response

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(generate, "whole_response", recorded)
    settings = HttpSettings(
        host="127.0.0.1", port=0, model_id="org/tiny", tokenizer=_Words(), encoder=object()
    )
    router = FakeRouter(lambda gen: _responses(1, tokens=tokens))
    with TestClient(build_app(SimpleNamespace(settings=settings, stub=router))) as c:
        got = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": tokens, **body})
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == "w8 " * tokens
        assert len(threads) == 1 and threads[0].startswith("http-whole") == off_loop, threads


def test_prompt_logprobs_with_return_token_ids():
    body = CompletionRequest.model_validate(
        {"prompt": [4, 5, 6], "n": 2, "prompt_logprobs": 1, "return_token_ids": True}
    )
    out = whole.whole_response(_responses(2), body, False, "m", "http-x", TEXT)
    for c in out["choices"]:
        assert c["prompt_token_ids"] == [4, 5, 6] and c["token_ids"] == [8]
        assert c["prompt_logprobs"][2] == {
            "6": {"logprob": -0.25, "rank": 1, "decoded_token": "w6 "}
        }
