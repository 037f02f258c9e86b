"""A cross-encoder's scoring pairs (router/openai/scoring.py) repeat the query for every
document: their texts are bounded in all before any pair is built, so a small body cannot make a
request a thousand times its size. On FastAPI's test client with a fake router that records the
Embed requests it gets; the bound is the front's body limit here (a front built without the
router's sizes), else the router's gRPC limit."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from helpers.http_front import UnaryReply, front_app
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai import scoring

LIMIT = 1 << 20  # the front's body limit here: the pairs' bound


class _Router:
    """Embed answers logits (0, 1) for each input and keeps the requests' texts' bytes."""

    def __init__(self):
        self.sent_bytes = []

    def Embed(self, request, metadata=()):
        self.sent_bytes.append(sum(len(i.text.encode()) for i in request.inputs))
        reply = pdserve_pb2.EmbedResponse(prompt_tokens=len(request.inputs))
        for i in range(len(request.inputs)):
            reply.embeddings.add(index=i, values=[0.0, 1.0])
        return UnaryReply(reply)


@pytest.fixture
def client():
    router = _Router()
    app = front_app(router, max_body_bytes=LIMIT, labels=("no", "yes"))
    with TestClient(app) as c:
        yield c, router


def _counted(monkeypatch) -> list:
    """The texts whose size the front checks, one per pair built (scoring's own check)."""
    built = []
    monkeypatch.setattr(
        "pdserve.router.openai.state.FrontState.check_prompt_size",
        lambda self, texts, param: built.append(len(texts[0])),
    )
    return built


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/rerank", {"query": "q" * 2000, "documents": ["d"] * 1000}, "documents"),
        ("/v1/score", {"text_1": "q" * 2000, "text_2": ["d"] * 1000}, "text_2"),
    ],
)
def test_pairs_past_the_bound_are_a_413_before_any_is_built(client, monkeypatch, path, body, param):
    c, router = client
    built = _counted(monkeypatch)
    got = c.post(path, json=body)  # a 10 KB body whose pairs would be 2 MB
    error = got.json()["error"]
    assert got.status_code == 413 and error["code"] == "request_too_large", error
    assert error["param"] == param and f"send fewer {param}" in error["message"]
    assert "2001000 bytes" in error["message"] and f"the {LIMIT} one request" in error["message"]
    assert built == [] and router.sent_bytes == []


def test_pairs_within_the_bound_are_scored(client, monkeypatch):
    c, router = client
    built = _counted(monkeypatch)
    got = c.post("/v1/rerank", json={"query": "q" * 500, "documents": ["d"] * 1000})
    assert got.status_code == 200, got.text
    assert len(got.json()["results"]) == 1000
    assert built == [501] * 1000 and router.sent_bytes == [501_000]


def test_the_bound_counts_utf8_bytes_and_each_copy_of_the_query():
    query = "é" * 1000  # 2000 bytes of UTF-8
    pairs = [(query, "d")] * 3

    class Front:
        max_request_bytes = 6003
        settings = None

    scoring._check_pair_bytes(Front(), pairs, "documents")
    Front.max_request_bytes = 6002
    with pytest.raises(Exception, match="6003 bytes of text"):
        scoring._check_pair_bytes(Front(), pairs, "documents")
