"""The byte bound of the pooling endpoints' inputs in the HTTP front (router/openai/embeddings.py,
scoring.py), on FastAPI's test client with a fake router whose Embed records its requests: each
input of /classify is held to max_model_len's bytes on its own, as /v1/embeddings' are, so a
batch of inputs that each fit is served however many bytes they come to together (the call's
whole size stays bounded: a 413 past the router's request size); with truncate_prompt_tokens a
text past that bound reaches the router (which tokenizes it whole and keeps its first k tokens),
on every pooling endpoint, while without it the text is a 400 naming the input."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from helpers.http_front import EmbedRouter, front_app

MAX_MODEL_LEN = 128
PROMPT_BYTES = 635  # (128 - 1) * (4 + 1): the tests' word-level tokenizer's bound
ONE = "t5 " * 100  # 300 bytes: fits on its own
LONG = "t5 " * 300  # 900 bytes: past the bound


def _client(labels=("no", "yes")):
    router = EmbedRouter()
    app = front_app(
        router, max_model_len=MAX_MODEL_LEN, max_prompt_bytes=PROMPT_BYTES, labels=labels
    )
    return TestClient(app), router


@pytest.mark.parametrize("inputs", [[ONE] * 3, ["t5"] * 2048], ids=["3x300B", "2048x2B"])
def test_classify_takes_a_batch_whose_inputs_each_fit(inputs):
    client, router = _client()
    with client:
        got = client.post("/classify", json={"input": inputs})
        assert got.status_code == 200, got.json()
        assert len(got.json()["data"]) == len(inputs) and len(router.calls) == 1


def test_classify_names_the_one_input_past_the_bound():
    client, router = _client()
    with client:
        got = client.post("/classify", json={"input": [ONE, LONG, ONE]})
        error = got.json()["error"]
        assert got.status_code == 400 and error["param"] == "input[1]", error
        assert error["code"] == "context_length_exceeded" and "900 bytes" in error["message"]
        assert router.calls == []


@pytest.mark.parametrize("path", ["/classify", "/v1/embeddings"])
def test_the_whole_call_is_bounded_as_embeddings_is(path):
    """2048 inputs of 2.4 KB, each within a bound of 4000 bytes (a larger model's), come to
    4.9 MB: more than the 4 MiB one request to the router takes, a 413 on either endpoint."""
    router = EmbedRouter()
    app = front_app(
        router,
        max_model_len=MAX_MODEL_LEN,
        max_prompt_bytes=4000,
        labels=("no", "yes"),
        max_body_bytes=8 << 20,
    )
    with TestClient(app) as client:
        got = client.post(path, json={"input": ["t5 " * 800] * 2048})
        error = got.json()["error"]
        assert got.status_code == 413 and error["code"] == "request_too_large", error
        assert error["param"] == "input" and router.calls == []
        assert client.post(path, json={"input": ["t5 " * 800] * 1000}).status_code == 200


BODIES = [
    ("/v1/embeddings", {"input": LONG}, "input", ()),
    ("/v1/embeddings", {"input": ["t5", LONG]}, "input[1]", ()),
    ("/classify", {"input": LONG}, "input", ("no", "yes")),
    ("/v1/score", {"text_1": "t5", "text_2": [LONG]}, "text_2", ()),
    ("/v1/rerank", {"query": "t5", "documents": [LONG]}, "documents", ()),
    ("/v1/score", {"text_1": "t5 ", "text_2": [LONG]}, "text_2[0]", ("no", "yes")),
]


@pytest.mark.parametrize("path, body, param, labels", BODIES)
def test_truncate_prompt_tokens_lifts_the_byte_bound(path, body, param, labels):
    client, router = _client(labels)
    with client:
        got = client.post(path, json=body)
        error = got.json()["error"]
        assert got.status_code == 400 and error["param"] == param, error
        assert "shorten it" in error["message"] and router.calls == []
        for k in (10, -1):
            got = client.post(path, json={**body, "truncate_prompt_tokens": k})
            assert got.status_code == 200, got.json()
            assert router.calls[-1].truncate_prompt_tokens == k
