"""Embeddings through the cluster (issue 52, must-show d): a random-weight tiny Qwen3 in float32
behind a Router with its HTTP front, a prefill worker and a decode worker in this process. The
vectors of /v1/embeddings (float and base64) and of PDServe.Embed equal HF's last-token
last_hidden_state, L2-normalised, within 1e-4; the decode worker never sees the request (its
Stats counters and Embed calls stay at zero); bad values are a 400 naming the field and the
server keeps serving. Priority through the same cluster: a non-zero priority under the router's
"priority" policy is served, under "fcfs" refused naming it."""

from __future__ import annotations

import base64
import json
import struct

import grpc
import pytest
import torch

from helpers.http import assert_error, post
from helpers.models import TINY_CONFIG
from helpers.threads import wait_until
from helpers.worker import start_decode, start_prefill, start_router, stop_all
from pdserve.protos.convert import engine_priority
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.router.admission import BATCH_METADATA_KEY
from pdserve.router.service import batch_priority

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
ENGINE = dict(dtype="float32", max_model_len=128)


def make_tiny_qwen3(path):
    """A random tiny Qwen3 (q/k norms, explicit head_dim) and the word-level tokenizer of
    tests/helpers/models.py ("t0".."t255"); returns the HF model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        **{**TINY_CONFIG, "max_position_embeddings": 256},
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=0,
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a skipped final norm cannot go unnoticed
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1").save_pretrained(
        path
    )
    return model


def hf_embedding(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        h = model.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(h, dim=-1)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    return str(path), make_tiny_qwen3(path)


@pytest.fixture(scope="module")
def cluster(qwen3):
    model_dir, _ = qwen3
    decode = start_decode(model_dir, engine=ENGINE)
    prefill = start_prefill(model_dir, engine=ENGINE)
    router = start_router(
        model_dir, decode, prefill, http_port=0, scheduling_policy="priority", max_model_len=128
    )
    channel = grpc.insecure_channel(router.address)
    yield router, prefill, decode, pdserve_pb2_grpc.PDServeStub(channel)
    stop_all([channel], router, prefill, decode)


def _decode_untouched(decode) -> None:
    with grpc.insecure_channel(decode.address) as ch:
        stats = worker_pb2_grpc.DecodeWorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10)
    assert stats.prefix_cache_queries == 0 and stats.kv_transfers == 0, stats
    assert stats.num_running == stats.num_waiting == stats.num_reserved == 0, stats
    assert decode.parts["decode"].servicer.embed_calls == 0


def test_http_embeddings_equal_hf_last_token_hidden_state_and_skip_the_decode_pool(qwen3, cluster):
    _, hf = qwen3
    router, prefill, decode, _ = cluster
    ids = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3] * 21, [7, 8]]
    texts = ["t40 t41 t42 t43", "t9"]
    status, _, body = post(router, "/v1/embeddings", {"input": ids, "user": "u1"})
    assert status == 200, body
    doc = json.loads(body)
    assert doc["object"] == "list" and [d["index"] for d in doc["data"]] == [0, 1, 2]
    assert doc["usage"] == {"prompt_tokens": 32, "total_tokens": 32}
    for one, d in zip(ids, doc["data"]):
        got = torch.tensor(d["embedding"])
        assert got.shape == (TINY_CONFIG["hidden_size"],)
        assert (got - hf_embedding(hf, one)).abs().max().item() < TOL
    status, _, body = post(
        router, "/v1/embeddings", {"input": texts, "encoding_format": "base64", "priority": -3}
    )
    assert status == 200, body
    for text, d in zip(texts, json.loads(body)["data"]):
        raw = base64.b64decode(d["embedding"])
        got = torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw))
        want = hf_embedding(hf, [int(w[1:]) for w in text.split()])
        assert (got - want).abs().max().item() < TOL
    status, _, body = post(router, "/v1/embeddings", {"input": "t5 t6 t7"})
    assert status == 200 and len(json.loads(body)["data"]) == 1, body
    _decode_untouched(decode)
    # nothing kept on the prefill worker beyond the requests (full blocks may stay cached)
    engine = prefill.parts["prefill"].servicer.loop.engine
    assert engine.scheduler.num_unfinished == 0


def test_grpc_embed_equals_hf(qwen3, cluster):
    _, hf = qwen3
    _, _, decode, stub = cluster
    req = pdserve_pb2.EmbedRequest(
        inputs=[
            pdserve_pb2.EmbedInput(token_ids=pdserve_pb2.TokenIds(ids=[11, 12, 13, 14, 15])),
            pdserve_pb2.EmbedInput(text="t20 t21"),
        ]
    )
    reply = stub.Embed(req, timeout=60)
    assert reply.prompt_tokens == 7 and [e.prompt_tokens for e in reply.embeddings] == [5, 2]
    for one, e in zip([[11, 12, 13, 14, 15], [20, 21]], reply.embeddings):
        assert (torch.tensor(list(e.values)) - hf_embedding(hf, one)).abs().max().item() < TOL
    _decode_untouched(decode)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "t5", "dimensions": 8}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input[0]"),
        ({"input": [5, -1]}, "input[1]"),
        ({"input": [300]}, "input"),
        ({"input": [5] * 200}, "input"),
        ({"input": "t5", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "t5", "priority": 1 << 31}, "priority"),
        ({"input": "t5", "frobnicate": 1}, "frobnicate"),
    ],
    ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else v,
)
def test_bad_embedding_values_are_a_400_naming_the_field(cluster, body, param):
    router = cluster[0]
    status, _, raw = post(router, "/v1/embeddings", body)
    assert_error(status, raw, 400, param)
    status, _, raw = post(router, "/v1/embeddings", {"input": "t5 t6"})
    assert status == 200, raw


def test_a_matryoshka_model_s_embeddings_are_cut_and_normalised_again(qwen3, cluster, tmp_path):
    """`dimensions` where the model is a Matryoshka one: its config.json says so (is_matryoshka:
    any width up to hidden_size), or the deployment does (matryoshka_dimensions: those widths
    only); each vector is HF's hidden state cut to the width and L2-normalised."""
    import shutil

    model_dir, hf = qwen3
    _, prefill, decode, _ = cluster
    said = tmp_path / "matryoshka"
    shutil.copytree(model_dir, said)
    config = json.loads((said / "config.json").read_text())
    (said / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    for model, matryoshka, good, bad in ((str(said), None, 8, 65), (model_dir, (16, 32), 16, 8)):
        router = start_router(
            model, decode, prefill, http_port=0, max_model_len=128, matryoshka=matryoshka
        )
        try:
            status, _, body = post(
                router, "/v1/embeddings", {"input": [5, 6, 7], "dimensions": good}
            )
            assert status == 200, body
            got = torch.tensor(json.loads(body)["data"][0]["embedding"])
            with torch.no_grad():
                h = hf.model(torch.tensor([[5, 6, 7]])).last_hidden_state[0, -1, :good].float()
            assert (got - torch.nn.functional.normalize(h, dim=-1)).abs().max().item() < TOL
            status, _, raw = post(router, "/v1/embeddings", {"input": "t5", "dimensions": bad})
            err = assert_error(status, raw, 400, "dimensions")
            assert str(bad) in err["message"]
            with grpc.insecure_channel(router.address) as ch, pytest.raises(grpc.RpcError) as e:
                pdserve_pb2_grpc.PDServeStub(ch).Embed(
                    pdserve_pb2.EmbedRequest(
                        inputs=[pdserve_pb2.EmbedInput(text="t5")], dimensions=good, task=1
                    ),
                    timeout=30,
                )
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            router.stop()


def test_priority_is_served_under_the_priority_policy(cluster):
    router, _, _, stub = cluster
    status, _, body = post(
        router,
        "/v1/completions",
        {"prompt": [5, 6, 7], "max_tokens": 2, "priority": 10, "temperature": 0},
    )
    assert status == 200, body
    req = pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=[5, 6, 7]),
        sampling=pdserve_pb2.SamplingParams(max_tokens=2, temperature=0),
        priority=-7,
    )
    finishes = [r for r in stub.Generate(req, timeout=60) if r.HasField("finish")]
    assert finishes[-1].finish.usage.completion_tokens == 2


def test_fcfs_router_refuses_a_priority_naming_it(qwen3):
    model_dir, _ = qwen3
    decode = start_decode(model_dir, worker_id="d1", engine=ENGINE)
    prefill = start_prefill(model_dir, worker_id="p1", engine=ENGINE)
    router = start_router(model_dir, decode, prefill, http_port=0, max_model_len=128)
    channel = grpc.insecure_channel(router.address)
    try:
        for path, body in (
            ("/v1/completions", {"prompt": [5, 6], "max_tokens": 1, "priority": 3}),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "t5"}], "priority": 1},
            ),
            ("/v1/embeddings", {"input": "t5", "priority": -2}),
        ):
            status, _, raw = post(router, path, body)
            err = assert_error(status, raw, 400, "priority")
            assert "scheduling_policy" in err["message"]
        with pytest.raises(grpc.RpcError) as e:
            pdserve_pb2_grpc.PDServeStub(channel).Embed(
                pdserve_pb2.EmbedRequest(inputs=[pdserve_pb2.EmbedInput(text="t5")], priority=4),
                timeout=30,
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "priority" in e.value.details()
        status, _, raw = post(router, "/v1/completions", {"prompt": [5, 6], "max_tokens": 1})
        assert status == 200, raw
    finally:
        stop_all([channel], router, prefill, decode)


def test_priority_travels_to_both_workers_engines(cluster, monkeypatch):
    router, prefill, decode, stub = cluster
    seen = []
    p_engine = prefill.parts["prefill"].servicer.loop.engine
    d_engine = decode.parts["decode"].servicer.loop.engine
    real_add, real_reserve = p_engine.add_request, d_engine.reserve

    def add(rid, prompt, params=None, **kw):
        seen.append(("prefill", kw.get("priority")))
        return real_add(rid, prompt, params, **kw)

    def reserve(rid, prompt, params=None, priority=0):
        seen.append(("decode", priority))
        return real_reserve(rid, prompt, params, priority)

    monkeypatch.setattr(p_engine, "add_request", add)
    monkeypatch.setattr(d_engine, "reserve", reserve)
    req = pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=[9, 8, 7, 6]),
        sampling=pdserve_pb2.SamplingParams(max_tokens=2, temperature=0),
        priority=42,
    )
    # two calls the test holds (start tags t and t + 1), the first ended: the virtual time is
    # t + 1, and the next calls of the same unit take t + 2 and t + 3 (router/admission.py)
    admission = router.servicer.admission
    held = [admission.enter(), admission.enter()]
    admission.leave(held[0])
    try:
        list(stub.Generate(req, timeout=60))
        stub.Embed(
            pdserve_pb2.EmbedRequest(inputs=[pdserve_pb2.EmbedInput(text="t3 t4")], priority=-9),
            timeout=60,
        )
    finally:
        admission.leave(held[1])
    # each engine's order: the priority, then the call's start tag in its tenant's fair share
    # (protos/convert.py engine_priority); one call's legs carry the same tag
    assert [(w, p >> 64) for w, p in seen] == [("decode", 42), ("prefill", 42), ("prefill", -9)]
    t = held[0].tag
    assert [p & ((1 << 64) - 1) for _, p in seen] == [t + 2, t + 2, t + 3], (t, seen)
    assert seen[0][1] == engine_priority(42, t + 2)
    # a Batch API line's calls (the front marks them) travel after every interactive one's
    seen.clear()
    mark = ((BATCH_METADATA_KEY, "batch_1"),)
    list(stub.Generate(req, timeout=60, metadata=mark))
    stub.Embed(
        pdserve_pb2.EmbedRequest(inputs=[pdserve_pb2.EmbedInput(text="t3 t4")], priority=-9),
        timeout=60,
        metadata=mark,
    )
    high, low = batch_priority(42), batch_priority(-9)
    assert [(w, p >> 64) for w, p in seen] == [
        ("decode", high),
        ("prefill", high),
        ("prefill", low),
    ]
    assert low > 1 << 29 and high == (1 << 30) + 42


def test_colocated_embeddings_run_on_the_colocated_worker(qwen3):
    model_dir, hf = qwen3
    worker = start_decode(model_dir, worker_id="c0", engine=ENGINE)
    router = start_router(model_dir, worker, colocated=True, http_port=0, max_model_len=128)
    try:
        status, _, body = post(router, "/v1/embeddings", {"input": [[5, 6, 7], [8, 9]]})
        assert status == 200, body
        for one, d in zip([[5, 6, 7], [8, 9]], json.loads(body)["data"]):
            want = hf_embedding(hf, one)
            assert (torch.tensor(d["embedding"]) - want).abs().max().item() < TOL
        assert worker.parts["decode"].servicer.embed_calls == 1
    finally:
        stop_all([], router, worker)


def test_the_openai_client_reads_the_embeddings(qwen3, cluster):
    openai = pytest.importorskip("openai")
    _, hf = qwen3
    router = cluster[0]
    client = openai.OpenAI(
        base_url=f"http://{router.http_address}/v1", api_key="unused", max_retries=0, timeout=60
    )
    ids = [[21, 22, 23], [24, 25, 26, 27]]
    model = client.models.list().data[0].id
    # unset: the client asks for base64 and decodes it itself
    for fmt in ({}, {"encoding_format": "float"}):
        got = client.embeddings.create(model=model, input=ids, **fmt)
        assert got.usage.prompt_tokens == 7
        for one, d in zip(ids, got.data):
            want = hf_embedding(hf, one)
            assert (torch.tensor(d.embedding) - want).abs().max().item() < TOL
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=model, input="t5", dimensions=8)
    assert e.value.body["param"] == "dimensions"


def test_a_client_that_leaves_frees_its_inputs_on_the_prefill_worker(cluster, monkeypatch):
    router, prefill, _, stub = cluster
    loop = prefill.parts["prefill"].servicer.loop
    aborted = []
    real_abort = loop.abort
    monkeypatch.setattr(
        loop, "abort", lambda rid, *a, **kw: aborted.append(rid) or real_abort(rid, *a, **kw)
    )
    # the most inputs a call takes, each near max_model_len: seconds of work on the prefill worker
    many = pdserve_pb2.EmbedRequest(
        inputs=[
            pdserve_pb2.EmbedInput(token_ids=pdserve_pb2.TokenIds(ids=[i % 250 + 2] * 120))
            for i in range(2048)
        ]
    )
    pending = stub.Embed.future(many, timeout=120)
    wait_until(lambda: loop.engine.scheduler.num_unfinished > 0, 60, "the inputs reach the engine")
    pending.cancel()
    wait_until(lambda: loop.engine.scheduler.num_unfinished == 0, 60, "the inputs aborted")
    assert aborted, "no input was still running when the client left: make the call bigger"
    status, _, raw = post(router, "/v1/embeddings", {"input": "t5 t6"})
    assert status == 200, raw
