"""What the pooling endpoints of the HTTP front (router/openai/embeddings.py, scoring.py) answer
beside their vectors and scores, on FastAPI's test client with a fake router whose Embed counts a
text's words as its tokens: a bi-encoder's /v1/score and /v1/rerank usage as vLLM counts it (each
pair's two texts, and a pad token between them where the tokenizer has one, though each distinct
text is embedded once), a cross-encoder's as the sum of its pair prompts; and, where `model` names
a LoRA adapter, the router is asked for that adapter and the answer's `model` is its name."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from helpers.http_front import EmbedRouter, Words, front_app
from pdserve.router.lora import RouterAdapters


class PaddedWords(Words):
    pad_token_id = 0


SCORE = {"text_1": "t5 t6", "text_2": ["t5 t6", "t8", "t9 t1"]}
RERANK = {"query": "t5 t6", "documents": ["t5 t6", "t8", "t9 t1"]}


@pytest.mark.parametrize("path, body", [("/v1/score", SCORE), ("/v1/rerank", RERANK)])
@pytest.mark.parametrize(
    "tokenizer, pad", [(Words(), 0), (PaddedWords(), 1)], ids=["no-pad", "pad"]
)
def test_bi_encoder_usage_counts_each_pairs_two_texts(path, body, tokenizer, pad):
    router = EmbedRouter()
    with TestClient(front_app(router, tokenizer=tokenizer)) as client:
        got = client.post(path, json=body)
        assert got.status_code == 200, got.json()
        want = (2 + pad + 2) + (2 + pad + 1) + (2 + pad + 2)
        assert got.json()["usage"]["prompt_tokens"] == want
        assert got.json()["usage"]["total_tokens"] == want
        (call,) = router.calls  # each distinct text embedded once
        assert [i.text for i in call.inputs] == ["t5 t6", "t8", "t9 t1"]


def test_cross_encoder_usage_is_its_pair_prompts():
    router = EmbedRouter()
    with TestClient(front_app(router, labels=("no", "yes"))) as client:
        body = {"text_1": "t5 t6 ", "text_2": ["t5 t6", "t8"]}
        got = client.post("/v1/score", json=body)
        assert got.status_code == 200 and got.json()["usage"]["prompt_tokens"] == 4 + 3


CALLS = [
    ("/v1/embeddings", {"input": "t5 t6"}, ()),
    ("/v1/score", {"text_1": "t5", "text_2": "t6"}, ()),
    ("/v1/rerank", {"query": "t5", "documents": ["t6"]}, ()),
    ("/classify", {"input": "t5 t6"}, ("no", "yes")),
]


@pytest.mark.parametrize("path, body, labels", CALLS)
def test_an_adapters_name_is_asked_for_and_answered(path, body, labels):
    router = EmbedRouter()
    loras = RouterAdapters("org/tiny", enabled=True, modules={"sql": "/adapters/sql"})
    with TestClient(front_app(router, loras=loras, labels=labels)) as client:
        for model, answered in (("sql", "sql"), ("org/tiny", "org/tiny"), (None, "org/tiny")):
            sent = body if model is None else {**body, "model": model}
            got = client.post(path, json=sent)
            assert got.status_code == 200, got.json()
            assert got.json()["model"] == answered
            assert router.calls[-1].model == (model or "")
        got = client.post(path, json={**body, "model": "nope"})
        assert got.status_code == 404 and got.json()["error"]["param"] == "model"
