"""LoRA adapters on the pooling endpoints (router/service.py Embed, worker_common/embed.py), as
vLLM serves them: a tiny random Llama with two random PEFT adapters behind a 1P+1D cluster in this
process. /v1/embeddings with `model` an adapter's name answers that name and the adapter's
embedding (HF + PEFT's last-token hidden state, L2-normalised), which differs from the base
model's; the base model's (by its id, or with `model` unset) is unchanged beside them. /v1/score
and /v1/rerank take an adapter too. An unknown name is a 404 at the front and NOT_FOUND from the
router; a worker asked for an adapter it lacks refuses FAILED_PRECONDITION, the prefill worker's
Embed and the decode worker's (colocated) alike, and the decode worker's Embed under an adapter
gives the prefill worker's vector."""

from __future__ import annotations

import json

import grpc
import pytest
import torch

from helpers.http import assert_error, post
from helpers.lora import lora_engine, lora_family
from helpers.worker import start_decode, start_prefill, stop_all
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.router.server import Router, RouterConfig

pytestmark = pytest.mark.usefixtures("one_thread")
BASE = "tiny"
TOL = 1e-4
IDS = [5, 6, 7, 8, 9, 4, 3]
TEXT = " ".join(f"t{i}" for i in IDS)  # the tests' word-level tokenizer: "t5" is id 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base, dirs, models = lora_family(tmp_path_factory.mktemp("lora-pooling"), "llama")
    engine = lora_engine(dirs, max_loras=2, max_model_len=128)
    decode = start_decode(base, engine=engine)
    prefill = start_prefill(base, engine=engine)
    router = Router(
        RouterConfig(
            model=base,
            model_id=BASE,
            prefill_addresses=(prefill.address,),
            decode_addresses=(decode.address,),
            max_model_len=128,
            http_port=0,
            lora_enabled=True,
            lora_modules=tuple(dirs.items()),
        )
    ).start()
    channels = [grpc.insecure_channel(a) for a in (router.address, prefill.address, decode.address)]
    ns = dict(
        models=models,
        router=router,
        api=pdserve_pb2_grpc.PDServeStub(channels[0]),
        p=worker_pb2_grpc.PrefillWorkerStub(channels[1]),
        d=worker_pb2_grpc.DecodeWorkerStub(channels[2]),
    )
    yield type("Cluster", (), ns)
    stop_all(channels, router, prefill, decode)


def _reference(model, ids: list[int]) -> torch.Tensor:
    """HF's (or HF + PEFT's, its adapter active) last-token final hidden state, normalised."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    with torch.no_grad():
        h = inner.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(h, dim=-1)


def _embedding(cluster, body: dict) -> tuple[dict, torch.Tensor]:
    status, _, raw = post(cluster.router, "/v1/embeddings", body)
    assert status == 200, raw[:500]
    doc = json.loads(raw)
    return doc, torch.tensor(doc["data"][0]["embedding"])


def test_an_adapter_embeds_under_its_weights_and_the_base_model_is_unchanged(cluster):
    base = _reference(cluster.models["base"], IDS)
    for name in ("sql", "poem"):
        doc, got = _embedding(cluster, {"model": name, "input": TEXT})
        assert doc["model"] == name and doc["usage"]["prompt_tokens"] == len(IDS), doc["usage"]
        want = _reference(cluster.models[name], IDS)
        assert (got - want).abs().max().item() < TOL, name
        assert (got - base).abs().max().item() > 100 * TOL, f"{name} changed nothing"
    for body in ({"model": BASE, "input": TEXT}, {"input": IDS}):
        doc, got = _embedding(cluster, body)
        assert doc["model"] == BASE
        assert (got - base).abs().max().item() < TOL


def test_score_and_rerank_take_an_adapter_and_answer_its_name(cluster):
    status, _, raw = post(
        cluster.router, "/v1/score", {"model": "sql", "text_1": TEXT, "text_2": ["t5", TEXT]}
    )
    assert status == 200, raw[:500]
    doc = json.loads(raw)
    assert doc["model"] == "sql" and abs(doc["data"][1]["score"] - 1.0) < 1e-4, doc
    body = {"model": "poem", "query": TEXT, "documents": ["t5", TEXT]}
    status, _, raw = post(cluster.router, "/v1/rerank", body)
    assert status == 200, raw[:500]
    doc = json.loads(raw)
    assert doc["model"] == "poem" and doc["results"][0]["index"] == 1, doc


def test_an_unknown_model_is_not_found_at_the_front_and_the_router(cluster):
    status, _, raw = post(cluster.router, "/v1/embeddings", {"model": "nope", "input": TEXT})
    assert_error(status, raw, 404, param="model")
    request = pdserve_pb2.EmbedRequest(model="nope", inputs=[pdserve_pb2.EmbedInput(text=TEXT)])
    with pytest.raises(grpc.RpcError) as e:
        cluster.api.Embed(request, timeout=60)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "served: tiny, sql, poem" in e.value.details()


def test_both_workers_embed_under_an_adapter_and_refuse_one_they_lack(cluster):
    def call(lora_name: str) -> worker_pb2.WorkerEmbedRequest:
        request = worker_pb2.WorkerEmbedRequest(
            request_id=f"w-{lora_name}", pooling="last", normalize=True, lora_name=lora_name
        )
        request.prompts.add().ids.extend(IDS)
        return request

    vectors = []
    for stub in (cluster.p, cluster.d):
        reply = stub.Embed(call("sql"), timeout=60)
        vectors.append(torch.tensor(list(reply.embeddings[0].values)))
        with pytest.raises(grpc.RpcError) as e:
            stub.Embed(call("nope"), timeout=60)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no adapter of that name" in e.value.details()
    want = _reference(cluster.models["sql"], IDS)
    assert all((v - want).abs().max().item() < TOL for v in vectors)
