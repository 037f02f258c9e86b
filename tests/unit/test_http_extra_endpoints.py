"""The HTTP front's endpoints beyond generation (router/openai/tokenize.py) in-process, on FastAPI's
test client (no socket): /version, /v1/models/{id} (404 for another id), /detokenize and the
refusals of /tokenize and /detokenize (400 or 404 naming the field), the OpenAPI document with
every route and its request bodies, and the /docs page. Served through a router, with the
encoder tokenizing: tests/integration/test_http_logprobs_served.py.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from pdserve import __version__
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.app import build_app
from pdserve.router.openai.server import HttpSettings


class _Words:
    """A 10-token tokenizer: token i reads "ti"."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids)

    def __len__(self):
        return 10


class _Stub:
    async def ListModels(self, request, metadata=(), timeout=None):
        return pdserve_pb2.ListModelsResponse(
            models=[pdserve_pb2.ModelCard(id="org/tiny", max_model_len=64)]
        )


@pytest.fixture(scope="module")
def client():
    settings = HttpSettings(
        host="127.0.0.1",
        port=0,
        model_id="org/tiny",
        tokenizer=_Words(),
        encoder=object(),  # not reached by these tests
        max_model_len=64,
    )
    with TestClient(build_app(SimpleNamespace(settings=settings, stub=_Stub()))) as c:
        yield c


def test_version_and_model_by_id(client):
    assert client.get("/version").json() == {"version": __version__}
    card = client.get("/v1/models/org/tiny").json()
    assert card["id"] == "org/tiny" and card["max_model_len"] == 64
    got = client.get("/v1/models/nope")
    assert got.status_code == 404
    assert got.json()["error"]["code"] == "model_not_found"


def test_detokenize(client):
    assert client.post("/detokenize", json={"tokens": [3, 4]}).json() == {"prompt": "t3 t4"}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/detokenize", {"tokens": [3, 10]}, 400, "tokens"),
        ("/detokenize", {"tokens": [3], "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": [3], "extra": 1}, 400, "extra"),
        ("/tokenize", {"prompt": "t1", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            400,
            "continue_final_message",
        ),
    ],
)
def test_bad_bodies_name_the_field(client, path, body, status, param):
    got = client.post(path, json=body)
    assert got.status_code == status, got.text
    assert got.json()["error"]["param"] == param
    assert client.get("/version").status_code == 200  # it keeps serving


def test_openapi_lists_every_route_with_its_body(client):
    doc = client.get("/openapi.json").json()
    paths = doc["paths"]
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/models/{model_id}",
        "/tokenize",
        "/detokenize",
        "/version",
        "/health",
    ):
        assert path in paths, sorted(paths)
    body = paths["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/CompletionRequest"}
    fields = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"echo", "logprobs", "prompt_logprobs", "prompt"} <= set(fields)
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"top_logprobs", "chat_template_kwargs", "continue_final_message"} <= set(chat)
    refs = set(re.findall(r"#/components/schemas/(\w+)", json.dumps(doc)))
    assert refs <= set(doc["components"]["schemas"])  # every reference resolves
    page = client.get("/docs")
    assert page.status_code == 200 and "/openapi.json" in page.text
