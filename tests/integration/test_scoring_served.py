"""Scoring, reranking and classification served through the cluster (router/openai/scoring.py):
a Router with its HTTP front, a prefill worker and a decode worker in this process, on three tiny
random models in float32, each checked against HF transformers within 1e-4:

- a 2-label Qwen3ForSequenceClassification checkpoint (a cross-encoder reranker): /v1/score's
  and /v1/rerank's scores are sigmoid(logit[1] - logit[0]) of HF's logits for the query's text
  followed by the document's, /classify's probs are HF's softmax, ListModels names the labels,
  and a request to generate is a 400 (HTTP) or FAILED_PRECONDITION (gRPC) that says why;
- a generative Llama told its label tokens (classifier_from_token "t7", "t9"): the scores are
  those of HF's logits of the two tokens at the prompt's last position;
- the same Llama with no head (a bi-encoder): the score is the cosine similarity of HF's
  last-token hidden states, and /classify is a 400 that names what is missing.

Bad values are a 400 naming the field, and the server keeps serving."""

from __future__ import annotations

import json
import math
import shutil

import grpc
import pytest
import torch

from helpers.arch import build_arch_model
from helpers.http import assert_error, post
from helpers.worker import start_decode, start_prefill, start_router, stop_all
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
ENGINE = dict(dtype="float32", max_model_len=256)
LABEL_TOKENS = ("t7", "t9")


def _ids(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _serve(model_dir, engine=None, **router):
    decode = start_decode(model_dir, engine={**ENGINE, **(engine or {})})
    prefill = start_prefill(model_dir, engine={**ENGINE, **(engine or {})})
    r = start_router(model_dir, decode, prefill, http_port=0, max_model_len=256, **router)
    channel = grpc.insecure_channel(r.address)
    return (r, pdserve_pb2_grpc.PDServeStub(channel)), (channel, r, prefill, decode)


@pytest.fixture(scope="module")
def classifier_parts(tmp_path_factory):
    path = tmp_path_factory.mktemp("reranker")
    hf = build_arch_model(path, "qwen3", labels=("no", "yes"))
    served, parts = _serve(str(path))
    yield str(path), hf, served, parts
    stop_all([parts[0]], *parts[1:])


@pytest.fixture(scope="module")
def classifier(classifier_parts):
    _, hf, served, _ = classifier_parts
    return hf, *served


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return str(path), build_arch_model(path, "llama")


@pytest.fixture(scope="module")
def from_tokens(llama):
    model_dir, hf = llama
    served, parts = _serve(
        model_dir,
        engine={"classifier_from_token": LABEL_TOKENS},
        classifier_from_token=LABEL_TOKENS,
    )
    yield hf, *served
    stop_all([parts[0]], *parts[1:])


@pytest.fixture(scope="module")
def bi_encoder(llama):
    model_dir, hf = llama
    served, parts = _serve(model_dir)
    yield hf, *served
    stop_all([parts[0]], *parts[1:])


def _head_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = hf(torch.tensor([ids])).logits
    return out[0] if out.dim() == 2 else out[0, -1, [_ids(t)[0] for t in LABEL_TOKENS]]


def _json(status, _headers, body) -> dict:
    assert status == 200, body
    return json.loads(body)


QUERY = "t40 t41 t42"
DOCS = ["t50 t51", "t60 t61 t62 t63", "t70", "t80 t81 t82"]


@pytest.mark.parametrize("served", ["classifier", "from_tokens"])
def test_cross_encoder_scores_and_ranks_as_hf(request, served):
    hf, router, _ = request.getfixturevalue(served)
    want = []
    for d in DOCS:
        logits = _head_logits(hf, _ids(f"{QUERY} {d}"))
        want.append(_sigmoid(float(logits[1] - logits[0])))
    doc = _json(*post(router, "/v1/score", {"text_1": QUERY + " ", "text_2": DOCS}))
    assert [d["index"] for d in doc["data"]] == [0, 1, 2, 3]
    assert max(abs(d["score"] - w) for d, w in zip(doc["data"], want)) < TOL
    tokens = sum(len(_ids(f"{QUERY} {d}")) for d in DOCS)
    assert doc["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    # N:N pairs, and the log-odds without the activation
    doc = _json(
        *post(
            router,
            "/score",
            {"queries": [QUERY + " "] * 2, "documents": DOCS[:2], "use_activation": False},
        )
    )
    for d, w in zip(doc["data"], want[:2]):
        assert abs(d["score"] - math.log(w / (1 - w))) < 1e-3
    doc = _json(*post(router, "/v1/rerank", {"query": QUERY + " ", "documents": DOCS, "top_n": 3}))
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])[:3]
    assert [r["index"] for r in doc["results"]] == order
    for r in doc["results"]:
        assert abs(r["relevance_score"] - want[r["index"]]) < TOL
        assert r["document"] == {"text": DOCS[r["index"]]}
    docs = [{"text": d} for d in DOCS]
    doc = _json(
        *post(
            router,
            "/v2/rerank",
            {"query": QUERY + " ", "documents": docs, "return_documents": False},
        )
    )
    assert len(doc["results"]) == 4 and all(
        set(r) == {"index", "relevance_score"} for r in doc["results"]
    )


def test_a_deployment_s_chat_template_renders_each_pair(classifier_parts):
    """vLLM's score template: with a chat_template given, a pair is its "query" message then its
    "document" message as the template renders them; a template that cannot render one is a 400
    naming the pair."""
    model_dir, hf, _, (_, _, prefill, decode) = classifier_parts
    template = "{{ messages[0]['content'] }} t3 {{ messages[1]['content'] }}"
    router = start_router(
        model_dir, decode, prefill, http_port=0, max_model_len=256, chat_template=template
    )
    try:
        doc = _json(*post(router, "/v1/rerank", {"query": QUERY, "documents": DOCS[:2]}))
        for r in doc["results"]:
            logits = _head_logits(hf, _ids(f"{QUERY} t3 {DOCS[r['index']]}"))
            assert abs(r["relevance_score"] - _sigmoid(float(logits[1] - logits[0]))) < TOL
    finally:
        router.stop()
    router = start_router(
        model_dir,
        decode,
        prefill,
        http_port=0,
        max_model_len=256,
        chat_template="{{ raise_exception('not a score template') }}",
    )
    try:
        status, _, raw = post(router, "/v1/score", {"text_1": "t5", "text_2": ["t6", "t7"]})
        err = assert_error(status, raw, 400, "text_2[0]")
        assert "not a score template" in err["message"]
    finally:
        router.stop()


def test_classify_gives_hf_softmax_and_the_labels(classifier):
    hf, router, stub = classifier
    texts, ids = ["t5 t6 t7", "t20"], [[9, 10, 11, 12], [3] * 30]
    data = _json(*post(router, "/classify", {"input": texts}))["data"]
    data += _json(*post(router, "/classify", {"input": ids}))["data"]
    for one, d in zip([_ids(t) for t in texts] + ids, data):
        logits = _head_logits(hf, one)
        probs = torch.softmax(logits, -1)
        assert d["num_classes"] == 2 and d["label"] == ("no", "yes")[int(logits.argmax())]
        assert (torch.tensor(d["probs"]) - probs).abs().max().item() < TOL
    doc = _json(*post(router, "/v1/classify", {"input": "t5 t6 t7", "use_activation": False}))
    assert (torch.tensor(doc["data"][0]["probs"]) - _head_logits(hf, [5, 6, 7])).abs().max() < TOL
    (card,) = stub.ListModels(pdserve_pb2.ListModelsRequest(), timeout=10).models
    assert list(card.labels) == ["no", "yes"]
    with pytest.raises(grpc.RpcError) as e:  # a task the API does not define
        stub.Embed(
            pdserve_pb2.EmbedRequest(inputs=[pdserve_pb2.EmbedInput(text="t5")], task=5), timeout=30
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "PoolingTask" in e.value.details()


def test_a_classifier_refuses_to_generate_and_says_why(classifier):
    _, router, stub = classifier
    status, _, raw = post(router, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
    assert "classifier" in assert_error(status, raw, 400)["message"]
    with pytest.raises(grpc.RpcError) as e:
        list(
            stub.Generate(
                pdserve_pb2.GenerateRequest(
                    token_ids=pdserve_pb2.TokenIds(ids=[5, 6]),
                    sampling=pdserve_pb2.SamplingParams(max_tokens=2),
                ),
                timeout=30,
            )
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "/v1/rerank" in e.value.details()
    _json(*post(router, "/v1/score", {"text_1": "t5", "text_2": "t6"}))


def test_a_model_without_a_head_scores_by_cosine_similarity(bi_encoder):
    hf, router, stub = bi_encoder

    def hidden(text):
        with torch.no_grad():
            return hf.model(torch.tensor([_ids(text)])).last_hidden_state[0, -1]

    doc = _json(*post(router, "/v1/rerank", {"query": QUERY, "documents": DOCS}))
    want = [float(torch.cosine_similarity(hidden(QUERY), hidden(d), dim=0)) for d in DOCS]
    for r in doc["results"]:
        assert abs(r["relevance_score"] - want[r["index"]]) < TOL
    assert [r["index"] for r in doc["results"]] == sorted(range(4), key=lambda i: -want[i])
    # vLLM's count: each pair's query and document (and a pad token between them where the
    # tokenizer has one: this one has none), though each distinct text is embedded once
    tokens = sum(len(_ids(QUERY)) + len(_ids(d)) for d in DOCS)
    assert doc["usage"]["prompt_tokens"] == tokens
    status, _, raw = post(router, "/classify", {"input": "t5"})
    assert "classification head" in assert_error(status, raw, 400)["message"]
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(
            pdserve_pb2.EmbedRequest(
                inputs=[pdserve_pb2.EmbedInput(text="t5")], task=pdserve_pb2.POOLING_TASK_CLASSIFY
            ),
            timeout=30,
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/score", {"text_1": "t5"}, "any"),
        ("/v1/score", {"text_1": "t5", "documents": ["t6"]}, "any"),
        ("/v1/score", {"text_1": ["t5", "t6"], "text_2": ["t7", "t8", "t9"]}, "any"),
        ("/v1/score", {"text_1": "t5", "text_2": []}, "text_2"),
        ("/v1/score", {"text_1": "t5", "text_2": ["t5 " * 300]}, "text_2"),
        ("/v1/rerank", {"query": "t5", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "t5", "documents": ["t6"] * 1001}, "documents"),
        ("/v1/rerank", {"query": "t5 " * 200, "documents": ["t6 " * 100]}, "documents"),
        ("/v1/rerank", {"query": "t5", "documents": ["t6"], "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": "t5", "documents": [{"txt": "t6"}]}, "any"),
        ("/v1/rerank", {"query": 5, "documents": ["t6"]}, "query"),
        ("/v1/rerank", {"query": "t5", "documents": ["t6"], "use_activation": 1}, "use_activation"),
        ("/classify", {"input": [300]}, "input"),
        ("/classify", {"input": []}, "input"),
        ("/classify", {"input": "t5", "frobnicate": 1}, "frobnicate"),
    ],
    ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else v,
)
def test_bad_values_are_a_400_naming_the_field(classifier, path, body, param):
    _, router, _ = classifier
    status, _, raw = post(router, path, body)
    assert_error(status, raw, 400, param)
    _json(*post(router, "/v1/rerank", {"query": "t5", "documents": ["t6 t7"]}))


def _copy_with_pair_template(src: str, dst, use_pad_token: bool | None):
    """`src`'s model in `dst` with a tokenizer whose pair encoding puts t3 between the texts (as
    BERT's puts its SEP), and config.json's use_pad_token as given (None: not set)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    if use_pad_token is not None:
        config["use_pad_token"] = use_pad_token
    (dst / "config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="$A", pair="$A t3 $B", special_tokens=[("t3", 3)]
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1").save_pretrained(
        dst
    )
    return PreTrainedTokenizerFast.from_pretrained(dst)


def test_a_cross_encoder_reads_a_pair_as_its_tokenizer_encodes_one(classifier_parts, tmp_path):
    """vLLM's rule for a pair without a score template: the tokenizer's pair encoding (text,
    text_pair: its separator between the texts) unless config.json's use_pad_token is false,
    which joins the two texts; truncate_prompt_tokens cuts the pair as the tokenizer does."""
    model_dir, hf, _, (_, _, prefill, decode) = classifier_parts
    for use_pad_token in (None, False):
        dst = tmp_path / f"pair-{use_pad_token}"
        tok = _copy_with_pair_template(model_dir, dst, use_pad_token)
        router = start_router(str(dst), decode, prefill, http_port=0, max_model_len=256)
        try:
            # a space after the query, so that joined texts are the same words (HF's head would
            # pool another position after a word the vocabulary lacks: its id is the pad id)
            query = QUERY + " "
            for k in (None, 4):
                body = {"query": query, "documents": DOCS}
                if k is not None:
                    body["truncate_prompt_tokens"] = k
                doc = _json(*post(router, "/v1/rerank", body))
                if use_pad_token is None:
                    cut = {} if k is None else {"truncation": True, "max_length": k}
                    prompts = [tok(text=query, text_pair=d, **cut)["input_ids"] for d in DOCS]
                    assert k is not None or prompts[0] == [*_ids(QUERY), 3, *_ids(DOCS[0])]
                else:  # the texts joined: no separator
                    prompts = [tok(query + d)["input_ids"][:k] for d in DOCS]
                    assert k is not None or prompts[0] == _ids(f"{QUERY} {DOCS[0]}")
                for r in doc["results"]:
                    logits = _head_logits(hf, prompts[r["index"]])
                    want = _sigmoid(float(logits[1] - logits[0]))
                    assert abs(r["relevance_score"] - want) < TOL, (use_pad_token, k, r)
                tokens = sum(len(p) for p in prompts)
                assert doc["usage"]["prompt_tokens"] == tokens, (use_pad_token, k, doc["usage"])
        finally:
            router.stop()
