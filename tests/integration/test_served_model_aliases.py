"""vLLM's several --served-model-name through a router's HTTP front and gRPC API
(RouterConfig.model_aliases, router/lora.py): /v1/models has a card for the model's id and one
for each alias, a request naming an alias runs the base model and its answer names the model as
the request did (vLLM's rule), gRPC's Generate takes the alias too, and a name served nowhere is
a 404 (NOT_FOUND) listing every served name."""

from __future__ import annotations

import json

import grpc
import pytest

from helpers.http import MODEL, Workers, assert_error, post, request
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

pytestmark = pytest.mark.usefixtures("one_thread")

ALIASES = ("tiny-alias", "org/other-name")


@pytest.fixture(scope="module", name="router")
def fixture_router(tiny_models):
    src, _ = tiny_models("llama-gqa")
    workers = Workers(src)
    router = workers.router(model_aliases=ALIASES)
    yield router
    router.stop()
    workers.stop()


def test_every_name_is_listed_and_runs_the_base_model(router):
    status, _, raw = request(router.http_address, "GET", "/v1/models")
    assert status == 200, raw
    cards = json.loads(raw)["data"]
    assert [c["id"] for c in cards] == [MODEL, *ALIASES]
    assert len({c["root"] for c in cards}) == 1 and all(c["parent"] is None for c in cards)
    status, _, raw = request(router.http_address, "GET", f"/v1/models/{ALIASES[1]}")
    assert status == 200 and json.loads(raw)["id"] == ALIASES[1], raw
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    texts = set()
    for name in (MODEL, *ALIASES):
        status, _, raw = post(router, "/v1/completions", {**body, "model": name})
        assert status == 200, raw
        doc = json.loads(raw)
        assert doc["model"] == name, doc
        texts.add(doc["choices"][0]["text"])
    assert len(texts) == 1  # the same model under each name


def test_grpc_takes_an_alias_and_an_unknown_name_lists_them_all(router):
    with grpc.insecure_channel(router.address) as channel:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        sampling = pdserve_pb2.SamplingParams(max_tokens=2, ignore_eos=True)
        call = pdserve_pb2.GenerateRequest(model=ALIASES[0], sampling=sampling)
        call.token_ids.ids.extend([5, 6, 7])
        replies = list(stub.Generate(call, timeout=60))
        assert replies[-1].finish.finish_reason == "length"
        call.model = "nope"
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(call, timeout=60))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert f"served: {MODEL}, {ALIASES[0]}, {ALIASES[1]}" in e.value.details()
    status, _, raw = post(router, "/v1/completions", {"model": "nope", "prompt": [5]})
    assert "tiny-alias" in assert_error(status, raw, 404)["message"]
