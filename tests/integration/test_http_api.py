"""The OpenAI-compatible HTTP front (router/openai/app.py) over raw HTTP (http.client, sockets):
bad input gets the OpenAI error shape and the right status while the server keeps serving, and
the wire format (models, health, metrics, response shapes, SSE). The cluster and the helpers are
in helpers/http.py; the `openai` client in test_http_openai_client.py; API keys, HTTPS and
overload in test_http_security.py.
"""

from __future__ import annotations

import json
import socket

import pytest

from helpers.http import (
    CHAT,
    GOOD,
    GOOD_CHAT,
    MAX_MODEL_LEN,
    MODEL,
    TIMEOUT,
    C,
    assert_error,
    post,
    request,
    serves,
    split,
    sse_events,
)
from helpers.models import random_prompts

# ---- bad input: the OpenAI error shape, the right status, and the server keeps serving --------
BAD = [
    # (id, path, body, status, param)
    ("malformed-json", C, b'{"model": "tiny", "prompt": ', 400, None),
    ("json-not-object", C, b"[1, 2, 3]", 400, None),
    ("empty-body", C, b"", 400, None),
    ("trailing-garbage", C, json.dumps(GOOD).encode() + b"}}", 400, None),
    ("lone-surrogate", C, b'{"model": "tiny", "prompt": "\\ud800"}', 400, "any"),
    ("temperature-string", C, {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("max-tokens-float", C, {**GOOD, "max_tokens": 1.5}, 400, "max_tokens"),
    ("n-bool", C, {**GOOD, "n": True}, 400, "n"),
    ("prompt-number", C, {**GOOD, "prompt": 5}, 400, "prompt"),
    ("model-empty", C, {"prompt": "t5", "model": ""}, 400, "model"),
    ("unknown-field", C, {**GOOD, "frobnicate": 1}, 400, "frobnicate"),
    (
        "unsupported-vllm-field",
        C,
        {**GOOD, "spaces_between_special_tokens": False},
        400,
        "spaces_between_special_tokens",
    ),
    # a model without fill-in-the-middle tokens (served: tests/integration/test_fim_served.py)
    ("suffix-without-fim-tokens", C, {**GOOD, "suffix": "t7"}, 400, "suffix"),
    (
        "repetition-pattern-too-long",
        C,
        {**GOOD, "max_repetition_pattern_size": 257, "repetition_min_count": 2},
        400,
        "max_repetition_pattern_size",
    ),
    (
        "repetition-min-above-max",
        C,
        {**GOOD, "max_repetition_pattern_size": 2, "min_repetition_pattern_size": 3},
        400,
        "min_repetition_pattern_size",
    ),
    (
        "repetition-span-too-long",
        C,
        {**GOOD, "max_repetition_pattern_size": 256, "repetition_min_count": 9},
        400,
        "repetition_min_count",
    ),
    ("temperature-too-high", C, {**GOOD, "temperature": 3.0}, 400, "temperature"),
    ("temperature-negative", C, {**GOOD, "temperature": -0.1}, 400, "temperature"),
    ("top-p-zero", C, {**GOOD, "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", C, {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("presence-penalty", C, {**GOOD, "presence_penalty": 5}, 400, "presence_penalty"),
    ("repetition-penalty-zero", C, {**GOOD, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("max-tokens-zero-without-echo", C, {**GOOD, "max_tokens": 0}, 400, "echo"),
    ("max-tokens-negative", C, {**GOOD, "max_tokens": -1}, 400, "max_tokens"),
    ("max-tokens-over-model-len", C, {**GOOD, "max_tokens": 100_000}, 400, "max_tokens"),
    ("min-tokens-over-max", C, {**GOOD, "min_tokens": 5}, 400, None),
    ("n-zero", C, {**GOOD, "n": 0}, 400, "n"),
    ("n-too-many", C, {**GOOD, "n": 65}, 400, "n"),
    ("nan", C, b'{"model": "tiny", "prompt": "t5", "temperature": NaN}', 400, "temperature"),
    ("infinity", C, b'{"model": "tiny", "prompt": "t5", "top_p": Infinity}', 400, "top_p"),
    ("overflow-to-inf", C, b'{"model": "tiny", "prompt": "t5", "min_p": 1e999}', 400, "min_p"),
    ("seed-past-int64", C, {**GOOD, "seed": 2**64}, 400, "seed"),
    ("stop-empty-string", C, {**GOOD, "stop": [""]}, 400, "stop[0]"),
    ("stop-too-many", C, {**GOOD, "stop": [f"s{i}" for i in range(65)]}, 400, "stop"),
    ("stop-too-long", C, {**GOOD, "stop": "x" * 513}, 400, "stop"),
    ("stop-token-past-vocab", C, {**GOOD, "stop_token_ids": [300]}, 400, None),
    ("logit-bias-past-vocab", C, {**GOOD, "logit_bias": {"300": 1}}, 400, None),
    ("logit-bias-key-not-an-id", C, {**GOOD, "logit_bias": {"t5": 1}}, 400, "logit_bias"),
    ("logit-bias-over-100", C, {**GOOD, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit-bias-bool", C, {**GOOD, "logit_bias": {"5": True}}, 400, "logit_bias"),
    (
        "logit-bias-too-many",
        C,
        {**GOOD, "logit_bias": {str(i): 1 for i in range(1025)}},
        400,
        "logit_bias",
    ),
    ("allowed-ids-empty", C, {**GOOD, "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("allowed-ids-past-vocab", C, {**GOOD, "allowed_token_ids": [5, 256]}, 400, None),
    ("cache-salt-too-long", C, {**GOOD, "cache_salt": "s" * 257}, 400, "cache_salt"),
    ("cache-salt-not-str", C, {**GOOD, "cache_salt": 7}, 400, "cache_salt"),
    ("truncate-zero", C, {**GOOD, "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("truncate-below-1", C, {**GOOD, "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
    ("bad-words-empty-word", C, {**GOOD, "bad_words": ["t5", ""]}, 400, "bad_words[1]"),
    ("bad-words-too-many", C, {**GOOD, "bad_words": ["t5"] * 129}, 400, "bad_words"),
    ("token-id-negative", C, {**GOOD, "prompt": [5, -1]}, 400, "prompt[1]"),
    ("token-id-past-vocab", C, {**GOOD, "prompt": [5, 256]}, 400, "prompt"),
    ("prompt-empty", C, {**GOOD, "prompt": ""}, 400, "prompt"),
    ("prompt-too-long", C, {**GOOD, "prompt": [5] * MAX_MODEL_LEN}, 400, "prompt"),
    ("text-too-long", C, {**GOOD, "prompt": "t5 " * 5000}, 400, "prompt"),
    (
        "chat-too-long",
        CHAT,
        {**GOOD_CHAT, "messages": [{"role": "user", "content": "é" * 100_000}]},
        400,
        "messages",
    ),
    ("65-sequences", C, {**GOOD, "prompt": ["t5"] * 13, "n": 5}, 400, None),
    ("65-prompts", C, {**GOOD, "prompt": [[5]] * 65}, 400, "prompt"),
    ("logprobs-past-the-bound", C, {**GOOD, "logprobs": 21}, 400, "logprobs"),
    ("echo-not-bool", C, {**GOOD, "echo": 1}, 400, "echo"),
    (
        "echo-logprobs-streamed",
        C,
        {**GOOD, "echo": True, "logprobs": 1, "stream": True},
        400,
        "echo",
    ),
    ("prompt-logprobs-past-the-bound", C, {**GOOD, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("stream-options-without-stream", C, {**GOOD, "stream_options": {}}, 400, "stream_options"),
    ("priority-not-enabled", C, {**GOOD, "priority": 5}, 400, "priority"),
    ("chat-echo", CHAT, {**GOOD_CHAT, "echo": True}, 400, "echo"),
    ("unknown-model", C, {**GOOD, "model": "gpt-5"}, 404, "model"),
    ("chat-unknown-model", CHAT, {**GOOD_CHAT, "model": "nope"}, 404, "model"),
    (
        "chat-bad-role",
        CHAT,
        {**GOOD_CHAT, "messages": [{"role": "function", "content": "x"}]},
        400,
        "messages[0].role",
    ),
    ("chat-empty-messages", CHAT, {**GOOD_CHAT, "messages": []}, 400, "messages"),
    ("chat-messages-missing", CHAT, {"model": MODEL}, 400, "messages"),
    ("chat-message-not-object", CHAT, {**GOOD_CHAT, "messages": ["hi"]}, 400, "messages[0]"),
    (
        "chat-content-missing",
        CHAT,
        {**GOOD_CHAT, "messages": [{"role": "user"}]},
        400,
        "messages[0].content",
    ),
    (
        "chat-image-part",
        CHAT,
        {
            **GOOD_CHAT,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        },
        400,
        "messages[0].content[0].image_url",  # neither a base64 data URL nor an http(s) link
    ),
    ("chat-top-logprobs-alone", CHAT, {**GOOD_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    (
        "chat-top-logprobs-past-the-bound",
        CHAT,
        {**GOOD_CHAT, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    (
        "chat-continue-with-generation-prompt",
        CHAT,
        {**GOOD_CHAT, "continue_final_message": True},
        400,
        "continue_final_message",
    ),
    (
        "chat-template-kwargs-reserved",
        CHAT,
        {**GOOD_CHAT, "chat_template_kwargs": {"messages": []}},
        400,
        "chat_template_kwargs",
    ),
    (
        "chat-template-kwargs-list",
        CHAT,
        {**GOOD_CHAT, "chat_template_kwargs": [1]},
        400,
        "chat_template_kwargs",
    ),
    ("tokenize-neither", "/tokenize", {"model": MODEL}, 400, "messages"),
    ("tokenize-unknown-model", "/tokenize", {"model": "nope", "prompt": "t5"}, 404, "model"),
    ("tokenize-too-long", "/tokenize", {"prompt": "t5 " * 5000}, 400, "prompt"),
    ("detokenize-past-vocab", "/detokenize", {"tokens": [5, 256]}, 400, "tokens"),
    ("detokenize-not-ids", "/detokenize", {"tokens": "t5"}, 400, "tokens"),
    ("chat-tools", CHAT, {**GOOD_CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    (  # structured output itself: tests/integration/test_structured_output_served.py
        "chat-response-format-unknown-type",
        CHAT,
        {**GOOD_CHAT, "response_format": {"type": "json"}},
        400,
        "response_format.type",
    ),
    ("chat-max-tokens-disagree", CHAT, {**GOOD_CHAT, "max_completion_tokens": 3}, 400, None),
    ("chat-n-too-many", CHAT, {**GOOD_CHAT, "n": 1000}, 400, "n"),
]


@pytest.mark.parametrize("path,body,status,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gets_the_openai_error_and_the_server_keeps_serving(
    router, idle, path, body, status, param
):
    got_status, _, got = post(router, path, body)
    assert_error(got_status, got, status, param)
    serves(router)


def test_prompts_too_long_for_the_model_say_context_length_exceeded(router, idle):
    for body in (
        {**GOOD, "prompt": [5] * MAX_MODEL_LEN},  # counted in tokens by the router
        {**GOOD, "prompt": "t5 " * 5000},  # refused by its bytes before the call
        {**GOOD, "max_tokens": MAX_MODEL_LEN + 1},
    ):
        status, _, got = post(router, C, body)
        err = assert_error(status, got, 400)
        assert err["code"] == "context_length_exceeded" and "max_model_len" in err["message"]


def test_body_over_the_limit_is_refused_unread_by_content_length_or_by_bytes(router, idle):
    limit = router.http.settings.max_body_bytes
    host, port = split(router.http_address)
    # a Content-Length over the limit: refused before a byte of the body is read
    with socket.create_connection((host, port), timeout=TIMEOUT) as s:
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {limit + 1}\r\n\r\n".encode()
        )
        status, body = read_response(s)
    assert_error(status, body, 413)
    # no Content-Length (chunked): refused once more than the limit has arrived
    with socket.create_connection((host, port), timeout=TIMEOUT) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b" " * (256 << 10)
        sent = 0
        try:
            while sent <= limit + len(chunk):
                s.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed: the response is read below
        status, body = read_response(s)
    assert_error(status, body, 413)
    serves(router)


def read_response(s: socket.socket) -> tuple[int, bytes]:
    """Status and body of one HTTP/1.1 response with a Content-Length, read from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = s.recv(65536)
        assert more, data
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers["content-length"])
    while len(body) < length:
        more = s.recv(65536)
        assert more
        body += more
    return int(lines[0].split()[1]), body


def test_error_responses_are_counted_by_status(router, idle):
    """pdserve:http_errors_total{status} counts the front's own refusals and the failed Generate
    calls it relays; pdserve:request_errors_total counts only the calls that reached Generate."""
    registry, model = router.metrics_registry, router.servicer.options.model_id

    def total(name: str, **labels) -> float:
        return sum(
            sample.value
            for family in registry.collect()
            for sample in family.samples
            if sample.name == name
            and sample.labels["model_name"] == model
            and labels.items() <= sample.labels.items()
        )

    before = {s: total("pdserve:http_errors_total", status=s) for s in ("400", "404")}
    relayed = total("pdserve:request_errors_total")
    assert_error(*post(router, C, b"{not json")[::2], 400)  # the front's own: no Generate call
    assert_error(*request(router.http_address, "GET", "/v1/nothing")[::2], 404)
    assert total("pdserve:request_errors_total") == relayed
    assert_error(*post(router, C, {**GOOD, "max_tokens": MAX_MODEL_LEN + 1})[::2], 400)
    assert total("pdserve:request_errors_total") == relayed + 1  # this one reached Generate
    assert total("pdserve:http_errors_total", status="400") == before["400"] + 2
    assert total("pdserve:http_errors_total", status="404") == before["404"] + 1
    serves(router)


def test_unknown_paths_and_methods_get_the_error_shape(router):
    status, _, body = request(router.http_address, "GET", "/v1/nothing")
    assert_error(status, body, 404)
    status, _, body = request(router.http_address, "GET", "/v1/completions")
    assert_error(status, body, 405)


def test_n_2_choices_in_the_raw_stream_carry_their_index(router, idle):
    """TokenDelta.index and Finish.index become choices[i].index; each sequence gets its own
    finish chunk, and the usage counts both."""
    status, _, body = post(
        router,
        C,
        {
            **GOOD,
            "n": 2,
            "max_tokens": 4,
            "temperature": 1.0,
            "seed": 1,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200, body
    events = sse_events(body)
    indices = {c["index"] for e in events for c in e["choices"]}
    finished = sorted(c["index"] for e in events for c in e["choices"] if c["finish_reason"])
    assert indices == {0, 1} and finished == [0, 1]
    assert events[-1]["usage"]["completion_tokens"] == 8


# ---- the wire format ---------------------------------------------------------------------------
def test_models_health_and_metrics(router):
    status, _, body = request(router.http_address, "GET", "/v1/models")
    assert status == 200
    doc = json.loads(body)
    assert doc["object"] == "list" and [m["id"] for m in doc["data"]] == [MODEL]
    assert doc["data"][0]["object"] == "model" and doc["data"][0]["max_model_len"] == MAX_MODEL_LEN
    status, _, body = request(router.http_address, "GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, headers, body = request(router.http_address, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    from prometheus_client import generate_latest

    # what the router's registry renders (its figures are another part's; only the route here)
    assert body.split(b"\n")[0] == generate_latest(router.metrics_registry).split(b"\n")[0]


def test_completion_response_shape_usage_and_stage_timings(router, idle):
    prompt = random_prompts([9], seed=3)[0]
    status, _, body = post(
        router, C, {**GOOD, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    )
    assert status == 200, body
    doc = json.loads(body)
    assert doc["object"] == "text_completion" and doc["id"].startswith("cmpl-")
    assert doc["model"] == MODEL and isinstance(doc["created"], int)
    (choice,) = doc["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["text"]
    assert doc["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": 6,
        "total_tokens": 15,
        "prompt_tokens_details": {
            "cached_tokens": doc["usage"]["prompt_tokens_details"]["cached_tokens"]
        },
    }
    ext = doc["pdserve"]
    assert ext["prefill_worker"] == "p0" and ext["decode_worker"] == "d0"
    timings = ext["timings"]
    assert timings and all(v is None or v >= 0 for v in timings.values())
    assert timings["ttft_s"] is not None and timings["e2e_s"] >= timings["ttft_s"]


def test_logit_bias_allowed_token_ids_and_bad_words_reach_both_workers(router, idle):
    """The prefill worker samples the first token and the decode worker the rest: both apply the
    body's logit_bias (a +100 all but forces its token), allowed_token_ids and bad_words."""
    prompt = random_prompts([9], seed=4)[0]
    base = {**GOOD, "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    status, _, body = post(router, C, base)
    assert status == 200, body
    plain = json.loads(body)["choices"][0]["text"].split()
    status, _, body = post(router, C, {**base, "logit_bias": {"42": 100}})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"].split() == ["t42"] * 5 != plain
    status, _, body = post(router, C, {**base, "allowed_token_ids": [9, 10]})
    assert status == 200, body
    words = json.loads(body)["choices"][0]["text"].split()
    assert len(words) == 5 and set(words) <= {"t9", "t10"} and words != plain
    # a banned word stays banned under a +100 bias (the ban comes first, as in vLLM)
    status, _, body = post(router, C, {**base, "logit_bias": {"42": 100}, "bad_words": ["t42"]})
    assert status == 200, body
    words = json.loads(body)["choices"][0]["text"].split()
    assert len(words) == 5 and "t42" not in words


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_repetition_detection_ends_a_repeating_answer(router, idle, chat):
    """vLLM's repetition detection through both workers: one allowed token, so the answer repeats
    it; four in a row end it as "repetition" (vLLM's finish_reason and stop_reason)."""
    fields = {
        "max_tokens": 12,
        "temperature": 0,
        "allowed_token_ids": [5],
        "max_repetition_pattern_size": 2,
        "repetition_min_count": 4,
    }
    path, body = (CHAT, GOOD_CHAT) if chat else (C, GOOD)
    status, _, raw = post(router, path, {**body, **fields})
    assert status == 200, raw[:300]
    got = json.loads(raw)
    choice = got["choices"][0]
    assert choice["finish_reason"] == "repetition", choice
    assert choice["stop_reason"] == "repetition_detected"
    assert got["usage"]["completion_tokens"] == 4


def test_cache_salt_keeps_each_salt_s_cached_prefix_to_itself(router, idle):
    """vLLM's cache_salt through both pools: a prompt's cached prefix is a hit for the same salt
    (prompt_tokens_details.cached_tokens) and not for another; the answers are the same."""
    prompt = random_prompts([70], seed=6)[0]
    base = {**GOOD, "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}

    def run(salt):
        status, _, body = post(router, C, {**base, "cache_salt": salt})
        assert status == 200, body
        doc = json.loads(body)
        return doc["usage"]["prompt_tokens_details"]["cached_tokens"], doc["choices"][0]["text"]

    first, text = run("tenant-a")
    again, text_again = run("tenant-a")
    other, text_other = run("tenant-b")
    assert first == 0 and again >= 64 and other == 0
    assert text == text_again == text_other


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_return_tokens_as_token_ids_names_each_logprob_s_token_by_id(router, idle, chat):
    """vLLM's return_tokens_as_token_ids: every token in the logprobs (sampled and alternatives)
    is "token_id:<id>", the ids of the tokens the plain answer names by text; the text itself
    and the numbers stay the same."""
    path, body = (CHAT, dict(GOOD_CHAT)) if chat else (C, dict(GOOD))
    body.update(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2 if not chat else True)
    if chat:
        body["top_logprobs"] = 2
    docs = []
    for flag in (False, True):
        status, _, raw = post(router, path, {**body, "return_tokens_as_token_ids": flag})
        assert status == 200, raw
        docs.append(json.loads(raw)["choices"][0])
    plain, by_id = docs
    if chat:
        assert plain["message"] == by_id["message"]
        pairs = [
            (p["token"], i["token"], p["top_logprobs"], i["top_logprobs"])
            for p, i in zip(plain["logprobs"]["content"], by_id["logprobs"]["content"], strict=True)
        ]
        tops = [([t["token"] for t in a], [t["token"] for t in b]) for _, _, a, b in pairs]
    else:
        assert plain["text"] == by_id["text"]
        lp_a, lp_b = plain["logprobs"], by_id["logprobs"]
        assert lp_a["token_logprobs"] == lp_b["token_logprobs"]
        pairs = list(zip(lp_a["tokens"], lp_b["tokens"], strict=True))
        tops = [(list(a), list(b)) for a, b in zip(lp_a["top_logprobs"], lp_b["top_logprobs"])]
    for text, named, *_ in pairs:
        assert named.startswith("token_id:") and text.strip() == f"t{named[9:]}"
    for texts, names in tops:
        assert [t.strip() for t in texts] == [f"t{n[9:]}" for n in names]


def test_truncate_prompt_tokens_serves_the_prompt_s_last_tokens(router, idle):
    """A prompt past max_model_len served as its last k tokens (vLLM's truncate_prompt_tokens):
    the same answer as those tokens sent alone; -1 keeps max_model_len - 1 of them."""
    long = random_prompts([MAX_MODEL_LEN + 40], seed=5)[0]
    base = {**GOOD, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    status, _, body = post(router, C, {**base, "prompt": long, "truncate_prompt_tokens": 8})
    assert status == 200, body
    cut = json.loads(body)
    status, _, body = post(router, C, {**base, "prompt": long[-8:]})
    assert status == 200, body
    alone = json.loads(body)
    assert cut["usage"]["prompt_tokens"] == 8 and cut["choices"] == alone["choices"]
    status, _, body = post(router, C, {**base, "prompt": long, "truncate_prompt_tokens": -1})
    assert status == 200, body
    assert json.loads(body)["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1
    status, _, body = post(router, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": 5})
    assert status == 200, body
    assert json.loads(body)["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_is_openai_sse_and_matches_the_whole_response(router, idle, chat):
    base = (
        {**GOOD_CHAT, "max_tokens": 7, "temperature": 0, "ignore_eos": True}
        if chat
        else {**GOOD, "max_tokens": 7, "temperature": 0, "ignore_eos": True}
    )
    path = CHAT if chat else C
    status, _, whole = post(router, path, base)
    assert status == 200
    whole = json.loads(whole)
    status, headers, body = post(
        router, path, {**base, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(body)
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith(
        "chatcmpl-" if chat else "cmpl-"
    )
    want_object = "chat.completion.chunk" if chat else "text_completion"
    assert all(e["object"] == want_object and e["model"] == MODEL for e in events)
    *chunks, last = events
    # include_usage: every other chunk has usage null, the last has no choices and the usage
    assert all("usage" in e and e["usage"] is None for e in chunks)
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    assert "pdserve" in last and not any("pdserve" in e for e in chunks)
    assert last["pdserve"]["decode_worker"] == "d0"
    reasons = [c["finish_reason"] for e in chunks for c in e["choices"]]
    assert (
        reasons[-1] == "length"
        and reasons.count("length") == 1
        and set(reasons) <= {None, "length"}
    )
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["delta"].get("content", "") for e in chunks for c in e["choices"])
        assert text == whole["choices"][0]["message"]["content"]
    else:
        text = "".join(c["text"] for e in chunks for c in e["choices"])
        assert text == whole["choices"][0]["text"]
    # without include_usage: no usage key, and the extension on the finish chunk
    status, _, body = post(router, path, {**base, "stream": True})
    events = sse_events(body)
    assert all("usage" not in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length" and "pdserve" in events[-1]


def test_a_failure_after_the_stream_started_is_an_error_event_then_done(router, idle, monkeypatch):
    from pdserve.router.openai.responses import stream

    def fail(finish, aborts=False):
        raise stream.ApiError(500, "injected", "server_error")

    monkeypatch.setattr(stream, "finish_reason", fail)
    status, _, body = post(router, C, {**GOOD, "stream": True})
    assert status == 200
    events = sse_events(body)
    assert set(events[-1]) == {"error"} and events[-1]["error"]["message"] == "injected"
    monkeypatch.undo()
    serves(router)


def _tokenized(router_, body: dict) -> list[int]:
    status, _, raw = post(router_, "/tokenize", body)
    assert status == 200, raw
    return json.loads(raw)["tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_return_token_ids_gives_the_prompt_s_and_each_choice_s_ids(router, idle, stream):
    """vLLM's return_token_ids (RL frameworks train on the exact ids): a chat's prompt_token_ids
    are what /tokenize renders for its messages, a completion's what it tokenizes (each prompt of
    a batch its own), each choice's token_ids the ids its text and its logprobs were made of;
    streamed, the ids of every chunk add up to the same."""
    chat_body = {**GOOD_CHAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    completion_body = {
        **GOOD,
        "prompt": ["t5 t6", "t7 t8 t9"],
        "n": 2,
        "max_tokens": 4,
        "ignore_eos": True,
        "logprobs": 0,
    }
    for path, body in ((CHAT, chat_body), (C, completion_body)):
        plain_status, _, plain = post(router, path, {**body, "stream": False})
        assert plain_status == 200, plain
        status, _, raw = post(router, path, {**body, "stream": stream, "return_token_ids": True})
        assert status == 200, raw
        doc = _gathered(raw, path == CHAT) if stream else json.loads(raw)
        if path == CHAT:
            want = _tokenized(router, {"model": MODEL, "messages": body["messages"]})
            assert doc["prompt_token_ids"] == want
            text = json.loads(plain)["choices"][0]["message"]["content"]
            ids = doc["choices"][0]["token_ids"]
            assert " ".join(f"t{i}" for i in ids) == text.strip()  # the word-level test vocab
            continue
        for choice in doc["choices"]:
            prompt = body["prompt"][choice["index"] // 2]
            assert choice["prompt_token_ids"] == _tokenized(router, {"prompt": prompt})
            assert len(choice["token_ids"]) == 4
            if not stream:  # each id is the token the logprobs name
                names = [t.strip() for t in choice["logprobs"]["tokens"]]
                assert names == [f"t{i}" for i in choice["token_ids"]]
    serves(router)


def _gathered(raw: bytes, chat: bool) -> dict:
    """A stream's return_token_ids fields gathered as a whole response has them."""
    out: dict = {"choices": {}}
    for event in sse_events(raw)[:-1]:
        if "prompt_token_ids" in event:
            out["prompt_token_ids"] = event["prompt_token_ids"]
        for c in event.get("choices") or ():
            choice = out["choices"].setdefault(c["index"], {"index": c["index"], "token_ids": []})
            choice["token_ids"] += c.get("token_ids") or []
            if "prompt_token_ids" in c:
                choice["prompt_token_ids"] = c["prompt_token_ids"]
            assert chat or c.get("finish_reason") or "token_ids" in c, c
    out["choices"] = [out["choices"][i] for i in sorted(out["choices"])]
    return out
