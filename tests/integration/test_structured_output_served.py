"""Structured output served: a router in front of a prefill and a decode worker on a tiny random
model with a byte-level tokenizer. Completions and chat with response_format, vLLM's
structured_outputs and guided_* give outputs that follow their grammar (the first token sampled
on the prefill worker, the rest on the decode worker; or all on the decode worker through a
colocated router), the same tokens as one engine alone; bad
values get a 400 naming the body's field (gRPC: INVALID_ARGUMENT naming sampling.structured),
and the router keeps serving."""

from __future__ import annotations

import json

import grpc
import pytest

from helpers.http import CHAT, C, Workers, assert_error, post, sse_events
from helpers.structured import GRAMMARS, SCHEMAS, byte_level_model, check_output
from helpers.threads import wait_until
from pdserve.engine import LLM, SamplingParams
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

MODEL = "tiny"
TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def workers(tiny_models, tmp_path_factory, one_thread):
    src, _ = tiny_models("llama-gqa")
    model_dir = byte_level_model(src, tmp_path_factory.mktemp("byte-chat"), TEMPLATE)
    w = Workers(model_dir)
    yield w
    w.stop()


@pytest.fixture(scope="module")
def router(workers):
    r = workers.router()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def colocated(workers):
    """A router that prefills on the decode worker too (planner/local_prefill.py)."""
    r = workers.router(colocated=True)
    yield r
    r.stop()


@pytest.fixture()
def idle(workers):
    yield workers
    wait_until(workers.idle, 5, f"the pools are not idle: {workers.stats()}")


def _ok(router, path, body) -> dict:
    status, _, raw = post(router, path, {"model": MODEL, **body})
    assert status == 200, raw
    return json.loads(raw)


def _texts(doc, chat: bool) -> list[tuple[str, str]]:
    return [
        ((c["message"]["content"] if chat else c["text"]), c["finish_reason"])
        for c in doc["choices"]
    ]


GBNF, LARK = GRAMMARS  # a GBNF and a Lark grammar (helpers/structured.py)


@pytest.mark.parametrize(
    "field, value, spec",
    [
        ("guided_choice", ["alpha", "beta", "gamma delta"], None),
        ("guided_regex", r"\d{3}-[a-z]{2,4}", None),
        ("structured_outputs", {"choice": ["yes", "no"]}, None),
        ("structured_outputs", {"regex": r"(ab|cd){2}!"}, None),
        ("structured_outputs", {"json": SCHEMAS[1]}, {"json_schema": SCHEMAS[1]}),
        ("guided_json", json.dumps(SCHEMAS[2]), {"json_schema": SCHEMAS[2]}),
        ("structured_outputs", {"grammar": GBNF}, {"grammar": GBNF}),
        ("guided_grammar", LARK, {"grammar": LARK}),
    ],
)
def test_completions_follow_the_grammar(router, idle, field, value, spec):
    if spec is None:
        spec = {"choice": value} if "choice" in field else {"regex": value}
        if field == "structured_outputs":
            spec = value
    body = {"prompt": "Answer: ", "max_tokens": 120, "n": 2, "temperature": 1.0, "seed": 5}
    doc = _ok(router, C, {**body, field: value})
    for text, reason in _texts(doc, chat=False):
        if reason == "stop" or "json_schema" not in spec:
            assert reason == "stop", (text, reason)
            check_output(spec, text)


def test_chat_response_format_streamed_and_not(router, idle):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMAS[0]}}
    body = {
        "messages": [{"role": "user", "content": "who?"}],
        "max_tokens": 150,
        "temperature": 0,
        "response_format": fmt,
    }
    whole = _ok(router, CHAT, body)
    ((text, reason),) = _texts(whole, chat=True)
    status, _, raw = post(router, CHAT, {"model": MODEL, **body, "stream": True})
    assert status == 200
    streamed = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in sse_events(raw) if e["choices"]
    )
    assert streamed == text
    if reason == "stop":
        check_output({"json_schema": SCHEMAS[0]}, text)
    obj = _ok(router, CHAT, {**body, "response_format": {"type": "json_object"}})
    ((text, reason),) = _texts(obj, chat=True)
    if reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_hand_off_equals_one_engine(workers, router, idle):
    """Greedy through the prefill and decode workers equals the engine alone, token for token."""
    llm = LLM(workers.model_dir, kv_cache_memory=1 << 20, max_model_len=256)
    try:
        prompt = llm.engine.tokenizer.encode("Say: ")
        for spec, field in (
            ({"regex": r"[a-f]{4,9}\.[0-9]{2}"}, {"guided_regex": r"[a-f]{4,9}\.[0-9]{2}"}),
            ({"json_schema": SCHEMAS[0]}, {"structured_outputs": {"json": SCHEMAS[0]}}),
        ):
            want = llm.generate(
                prompt,
                SamplingParams(temperature=0, max_tokens=80, structured=spec),
                use_tqdm=False,
            )[0].outputs[0]
            doc = _ok(router, C, {"prompt": prompt, "max_tokens": 80, "temperature": 0, **field})
            assert doc["choices"][0]["text"] == want.text
            assert doc["choices"][0]["finish_reason"] == want.finish_reason
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "path, extra, param",
    [
        (
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "no-such"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            CHAT,
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (CHAT, {"response_format": {"type": "yaml"}}, "response_format.type"),
        (C, {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        (C, {"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
        (C, {"structured_outputs": {}}, "structured_outputs"),
        (C, {"guided_choice": []}, "guided_choice"),
        (C, {"guided_json": "{not json"}, "guided_json"),
        (C, {"guided_regex": "a", "guided_choice": ["a"]}, None),
    ],
)
def test_bad_values_get_a_400_naming_the_field(router, idle, path, extra, param):
    body = {"model": MODEL, "max_tokens": 4, **extra}
    body.update(
        {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    )
    status, _, raw = post(router, path, body)
    err = assert_error(status, raw, 400, param)
    if param:
        assert err["message"].startswith(param), err
    ok = _ok(router, C, {"prompt": "x", "max_tokens": 20, "guided_choice": ["fine"]})
    assert ok["choices"][0]["text"] == "fine"


def test_colocated_router_follows_the_grammar(colocated, idle):
    """One engine samples every token, the first included."""
    doc = _ok(
        colocated,
        C,
        {"prompt": "Go: ", "max_tokens": 60, "n": 3, "seed": 3, "guided_regex": r"[xyz]{3}-\d"},
    )
    for text, reason in _texts(doc, chat=False):
        assert reason == "stop"
        check_output({"regex": r"[xyz]{3}-\d"}, text)


def test_grpc_structured_field(router, idle):
    stub = pdserve_pb2_grpc.PDServeStub(grpc.insecure_channel(router.address))
    req = pdserve_pb2.GenerateRequest(
        text="pick: ", sampling=pdserve_pb2.SamplingParams(temperature=0.7, max_tokens=30)
    )
    req.sampling.structured.choice.extend(["left", "right"])
    responses = list(stub.Generate(req, timeout=30))
    text = "".join(r.delta.text for r in responses if r.HasField("delta"))
    assert text in ("left", "right")
    for kwargs, field in (
        (dict(regex="(", choice=["a"]), "sampling.structured"),
        (dict(regex="("), "structured.regex"),
        (dict(json_schema='{"type": 5}'), "structured.json_schema"),
        (dict(choice=["a", ""]), "sampling.structured.choice"),
    ):
        bad = pdserve_pb2.GenerateRequest(text="x", sampling=pdserve_pb2.SamplingParams())
        bad.sampling.structured.CopyFrom(pdserve_pb2.StructuredOutput(**kwargs))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert field in e.value.details(), e.value.details()


def test_the_openai_client(router, idle):
    """The openai package's own shapes: response_format, and vLLM's fields through extra_body."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(
        base_url=f"http://{router.http_address}/v1", api_key="unused", max_retries=0, timeout=30
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "colour?"}],
        max_tokens=80,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "colour", "schema": SCHEMAS[1], "strict": True},
        },
    )
    check_output({"json_schema": SCHEMAS[1]}, chat.choices[0].message.content)
    done = client.completions.create(
        model=MODEL, prompt="pick", max_tokens=20, extra_body={"guided_choice": ["one", "two"]}
    )
    assert done.choices[0].text in ("one", "two")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=5, extra_body={"structured_outputs": {"regex": "("}}
        )
    assert "structured_outputs.regex" in str(e.value)
