"""Logprobs, echo and the new endpoints through a router with a prefill and a decode worker (and a
colocated router on the same decode worker), against the engine alone (tests/helpers/http.py's
tiny model): the prompt's logprobs (echo, prompt_logprobs; computed by whichever worker ran the
prompt) and every token's most likely alternatives (the first token's from the prefill worker,
the rest from the decode worker) on the HTTP front, streamed and not, and on the router's gRPC
API; lm-evaluation-harness's log-likelihood request (echo, logprobs=1, max_tokens 1, and 0);
/tokenize, /detokenize, /version, /v1/models/{id} and the OpenAPI document; `model` optional and
the chat template fields applied. Bad values of the new fields: tests/integration/test_http_api.py
(400 naming the field, the server keeps serving) and below for gRPC (INVALID_ARGUMENT).
"""

from __future__ import annotations

import json
import math

import grpc
import pytest

from helpers.http import (
    CHAT,
    MODEL,
    C,
    post,
    request,
    serves,
    sse_events,
)
from pdserve.engine import SamplingParams
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

TOL = 2e-3  # two engines (prefill, decode) and one alone: the same numbers up to rounding
PROMPTS = [[5, 9, 13, 20, 7, 7, 31], [40, 2, 17]]


def _engine_prompt(llm, prompt, k=1):
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)
    return out[0].prompt_logprobs


def _close(a, b) -> bool:
    return math.isclose(a, b, abs_tol=TOL)


@pytest.mark.parametrize("max_tokens", [1, 0])
@pytest.mark.parametrize("which", ["router", "colocated"])
def test_loglikelihood_requests_give_the_engines_prompt_logprobs(
    request_, llm, idle, which, max_tokens
):
    server = request_.getfixturevalue(which)
    # what lm-evaluation-harness's local-completions sends for log-likelihoods (a batch of ids)
    body = {
        "model": MODEL,
        "prompt": PROMPTS,
        "temperature": 0,
        "max_tokens": max_tokens,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    status, _, raw = post(server, C, body)
    assert status == 200, raw
    out = json.loads(raw)
    for choice in out["choices"]:
        prompt = PROMPTS[choice["index"]]
        lp = choice["logprobs"]
        want = _engine_prompt(llm, prompt)
        assert len(lp["token_logprobs"]) == len(prompt) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][: len(prompt)] == [f"t{t}" for t in prompt]
        for p in range(1, len(prompt)):
            got = lp["token_logprobs"][p]
            assert _close(got, want[p][prompt[p]]), (p, got, want[p])
            top = lp["top_logprobs"][p]  # the most likely token and the prompt token itself
            assert 1 <= len(top) <= 2 and f"t{prompt[p]}" in top
            best = max(want[p].items(), key=lambda kv: kv[1])
            assert _close(top[f"t{best[0]}"], best[1])
        assert choice["text"].startswith(" ".join(f"t{t}" for t in prompt))
    assert out["usage"]["completion_tokens"] == len(PROMPTS) * max_tokens


@pytest.fixture(name="request_")
def _request(request):
    return request


@pytest.mark.parametrize("which", ["router", "colocated"])
def test_top_logprobs_are_the_engines_for_every_token(request_, llm, idle, which):
    server = request_.getfixturevalue(which)
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=True, top_logprobs=3)
    want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 3}
    status, _, raw = post(server, C, body)
    assert status == 200, raw
    lp = json.loads(raw)["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"t{t}" for t in want.token_ids]
    for i, (t, x) in enumerate(zip(want.token_ids, want.logprobs)):
        assert t in x.top and _close(lp["token_logprobs"][i], x)  # greedy: t among the top
        top = lp["top_logprobs"][i]
        assert len(top) == 3 and set(top) == {f"t{a}" for a in x.top}  # greedy: t is among them
        for a, v in x.top.items():
            assert _close(top[f"t{a}"], v), (i, a)
    # the same numbers streamed
    status, _, raw = post(server, C, {**body, "stream": True})
    events = [e for e in sse_events(raw) if e["choices"] and e["choices"][0]["logprobs"]]
    streamed = [t for e in events for t in e["choices"][0]["logprobs"]["top_logprobs"]]
    assert [set(t) for t in streamed] == [set(t) for t in lp["top_logprobs"]]


def test_chat_top_logprobs_streamed_and_not(router, idle):
    body = {
        "messages": [{"role": "user", "content": "t5 t9"}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    status, _, raw = post(router, CHAT, body)  # no model: the served one
    assert status == 200, raw
    whole = json.loads(raw)
    assert whole["model"] == MODEL
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for c in content:
        tops = c["top_logprobs"]
        assert len(tops) == 2 and tops[0]["logprob"] >= tops[1]["logprob"]
        assert tops[0]["token"] == c["token"] and _close(tops[0]["logprob"], c["logprob"])
    status, _, raw = post(router, CHAT, {**body, "stream": True})
    chunks = [e for e in sse_events(raw) if e["choices"] and e["choices"][0]["logprobs"]]
    streamed = [c for e in chunks for c in e["choices"][0]["logprobs"]["content"]]
    assert [c["token"] for c in streamed] == [c["token"] for c in content]
    assert [len(c["top_logprobs"]) for c in streamed] == [2] * 4


def test_prompt_logprobs_field_and_echo_streamed(router, llm, idle):
    prompt = PROMPTS[1]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2}
    status, _, raw = post(router, C, body)
    assert status == 200, raw
    plp = json.loads(raw)["choices"][0]["prompt_logprobs"]
    want = _engine_prompt(llm, prompt, 2)
    assert plp[0] is None and len(plp) == len(prompt)
    for p in range(1, len(prompt)):
        assert _close(plp[p][str(prompt[p])]["logprob"], want[p][prompt[p]])
        ranked = {int(t) for t, e in plp[p].items() if e["rank"] is not None}
        assert ranked == {t for t, v in want[p].items() if v.rank <= 2}
    # echo streamed without logprobs: the prompt's text first
    status, _, raw = post(
        router, C, {**body, "prompt_logprobs": None, "echo": True, "stream": True}
    )
    assert status == 200, raw
    texts = [e["choices"][0]["text"] for e in sse_events(raw) if e["choices"]]
    assert texts[0] == "t40 t2 t17" and len("".join(texts)) > len(texts[0])


def test_grpc_api_carries_prompt_logprobs_and_alternatives(router, llm, idle):
    stub = pdserve_pb2_grpc.PDServeStub(grpc.insecure_channel(router.address))
    prompt = PROMPTS[0]
    sampling = pdserve_pb2.SamplingParams(
        temperature=0, max_tokens=3, logprobs=True, top_logprobs=2, prompt_logprobs=1
    )
    req = pdserve_pb2.GenerateRequest(sampling=sampling)
    req.token_ids.ids.extend(prompt)
    responses = list(stub.Generate(req, timeout=30))
    deltas = [r.delta for r in responses if r.HasField("delta")]
    (finish,) = [r.finish for r in responses if r.HasField("finish")]
    tops = [t for d in deltas for t in d.top_logprobs]
    assert len(tops) == 3 and all(len(t.token_ids) == 2 for t in tops)
    assert list(finish.prompt_token_ids) == prompt
    want = _engine_prompt(llm, prompt)
    assert len(finish.prompt_logprobs) == len(prompt) - 1
    for p, x in enumerate(finish.prompt_logprobs):
        assert _close(x, want[p + 1][prompt[p + 1]])
    for field, sampling in (
        ("sampling.top_logprobs", pdserve_pb2.SamplingParams(logprobs=True, top_logprobs=21)),
        ("sampling.top_logprobs", pdserve_pb2.SamplingParams(top_logprobs=1)),
        ("sampling.prompt_logprobs", pdserve_pb2.SamplingParams(prompt_logprobs=99)),
    ):
        bad = pdserve_pb2.GenerateRequest(sampling=sampling, text="t5")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    for field, chat in (
        ("chat.continue_final_message", dict(continue_final_message=True)),
        ("chat.chat_template_kwargs_json", dict(chat_template_kwargs_json="[")),
    ):
        bad = pdserve_pb2.GenerateRequest(chat=pdserve_pb2.ChatMessages(**chat))
        bad.chat.messages.add(role="user", content="t5")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    serves(router)


def test_tokenize_detokenize_version_model_and_openapi(router, idle):
    status, _, raw = post(router, "/tokenize", {"prompt": "t5 t6 t7", "return_token_strs": True})
    assert status == 200, raw
    assert json.loads(raw) == {
        "count": 3,
        "max_model_len": router.http.settings.max_model_len,
        "tokens": [5, 6, 7],
        "token_strs": ["t5", "t6", "t7"],
    }
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "t5"}]}
    _, _, raw = post(router, "/tokenize", chat)
    assert json.loads(raw)["tokens"] == [3, 5, 4, 7]  # the chat template, generation prompt
    _, _, raw = post(router, "/tokenize", {**chat, "add_generation_prompt": False})
    assert json.loads(raw)["tokens"] == [3, 5, 4]
    status, _, raw = post(router, "/detokenize", {"tokens": [5, 6, 7]})
    assert status == 200 and json.loads(raw) == {"prompt": "t5 t6 t7"}
    status, _, raw = request(router.http_address, "GET", "/version")
    assert status == 200 and json.loads(raw)["version"]
    status, _, raw = request(router.http_address, "GET", f"/v1/models/{MODEL}")
    assert status == 200 and json.loads(raw)["id"] == MODEL
    status, _, raw = request(router.http_address, "GET", "/v1/models/nope")
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"
    status, _, raw = request(router.http_address, "GET", "/openapi.json")
    assert status == 200
    paths = json.loads(raw)["paths"]
    for path in (C, CHAT, "/v1/models", "/v1/models/{model_id}", "/tokenize", "/detokenize"):
        assert path in paths, sorted(paths)
    status, headers, raw = request(router.http_address, "GET", "/docs")
    assert status == 200 and b"openapi.json" in raw


def test_chat_template_fields_change_what_runs(router, idle):
    base = {"messages": [{"role": "user", "content": "t5"}], "max_tokens": 1, "temperature": 0}
    usages = []
    for extra in ({}, {"add_generation_prompt": False}, {"chat_template_kwargs": {"x": 1}}):
        status, _, raw = post(router, CHAT, {**base, **extra})
        assert status == 200, raw
        usages.append(json.loads(raw)["usage"]["prompt_tokens"])
    assert usages == [4, 3, 4]
    cont = {
        "messages": [{"role": "user", "content": "t5"}, {"role": "assistant", "content": "t6"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "max_tokens": 1,
    }
    status, _, raw = post(router, CHAT, cont)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["prompt_tokens"] == 5  # t3 t5 t4 t3 t6: left open


@pytest.mark.parametrize("which", ["router", "colocated"])
def test_n_sequences_each_get_their_first_tokens_alternatives(request_, llm, idle, which):
    server = request_.getfixturevalue(which)
    prompt = PROMPTS[1]
    body = {"prompt": prompt, "max_tokens": 3, "n": 3, "seed": 7, "logprobs": 2, "ignore_eos": True}
    status, _, raw = post(server, C, body)
    assert status == 200, raw
    choices = json.loads(raw)["choices"]
    assert len(choices) == 3
    # every sequence's tokens sample from one model: its first token's alternatives are the
    # prompt's last position's, whichever token each sequence drew
    want = (
        llm.generate(
            prompt,
            SamplingParams(temperature=0, max_tokens=1, logprobs=True, top_logprobs=2),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .logprobs[0]
        .top
    )
    for c in choices:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == 3 and all(len(t) in (2, 3) for t in lp["top_logprobs"])
        first = lp["top_logprobs"][0]
        for a, v in want.items():
            assert _close(first[f"t{a}"], v)
        token = lp["tokens"][0]
        assert _close(first[token], lp["token_logprobs"][0])
