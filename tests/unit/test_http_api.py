"""The OpenAI-compatible HTTP front (router/http_api.py) end to end in one process: a DecodeWorker,
a PrefillWorker and Routers in front with http_port=0, on a tiny random model given a chat
template. Raw HTTP (http.client, sockets) for the wire format and bad input; the official
`openai` client for the API as people call it; API keys on both fronts; HTTPS; a client that
disconnects mid-stream frees its KV on both pools.
"""

from __future__ import annotations

import http.client
import json
import logging
import shutil
import socket
import ssl

import grpc
import pytest

from conftest import random_prompts, run_in_threads, tls_files, wait_until
from engine import LLM, SamplingParams
from protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from protos.security import TLSConfig
from router.server import Router, RouterConfig
from worker_helpers import record_aborts, start_decode, start_prefill, stop_all

openai = pytest.importorskip("openai")

MAX_MODEL_LEN = 256
MODEL = "tiny"
KEY, KEY2, WRONG = "sk-test-0123456789abcdef", "sk-second-key-xyz", "sk-wrong-0123456789"
TIMEOUT = 30.0
# a template the word-level test tokenizer can read: role and content words, then "t7"
CHAT_TEMPLATE = (
    "{% for m in messages %}t3 {{ m.content }} t4 {% endfor %}{% if add_generation_prompt %}t7"
    "{% endif %}"
)


def chat_model(tiny_models, tmp_path_factory) -> str:
    """The tiny llama-gqa model with a chat template in its tokenizer_config.json."""
    src, _ = tiny_models("llama-gqa")
    dst = tmp_path_factory.mktemp("chat-model")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return str(dst)


class Workers:
    def __init__(self, model_dir):
        engine = dict(max_model_len=MAX_MODEL_LEN)
        self.model_dir = model_dir
        self.decode = start_decode(model_dir, engine=engine, lease_ms=5000)
        self.prefill = start_prefill(model_dir, engine=engine)
        self.channels = [
            grpc.insecure_channel(a) for a in (self.decode.address, self.prefill.address)
        ]
        self.d = worker_pb2_grpc.DecodeWorkerStub(self.channels[0])
        self.p = worker_pb2_grpc.PrefillWorkerStub(self.channels[1])

    def router(self, **kwargs) -> Router:
        colocated = kwargs.get("colocated", False)
        settings = dict(
            model=self.model_dir,
            model_id=MODEL,
            prefill_addresses=() if colocated else (self.prefill.address,),
            decode_addresses=(self.decode.address,),
            max_model_len=MAX_MODEL_LEN,
            max_inflight=16,
            http_port=0,
        )
        return Router(RouterConfig(**{**settings, **kwargs})).start()

    def stats(self):
        return (
            self.d.Stats(worker_pb2.StatsRequest(), timeout=TIMEOUT),
            self.p.Stats(worker_pb2.StatsRequest(), timeout=TIMEOUT),
        )

    def idle(self) -> bool:
        d, p = self.stats()
        return (
            d.num_free_blocks == d.num_total_blocks
            and d.num_reserved == d.num_running == d.num_waiting == 0
            and p.num_free_blocks == p.num_total_blocks
            and p.num_running == p.num_waiting == 0
        )

    def stop(self):
        stop_all(self.channels, self.prefill, self.decode)


@pytest.fixture(scope="module")
def workers(tiny_models, tmp_path_factory, one_thread):
    w = Workers(chat_model(tiny_models, tmp_path_factory))
    yield w
    w.stop()


@pytest.fixture(scope="module")
def router(workers):
    r = workers.router()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def colocated(workers):
    """A colocated router on the same decode worker: it prefills there too, so every token's
    logprob comes from one engine."""
    r = workers.router(colocated=True)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def secured(workers, tmp_path_factory):
    """A router with two API keys and TLS on both fronts (the same certificate)."""
    files = tls_files(tmp_path_factory.mktemp("tls"))
    tls = TLSConfig(b"", files["cert"].read_bytes(), files["key"].read_bytes())
    r = workers.router(api_keys=(KEY, KEY2), client_tls=tls)
    r.ca_file = str(files["ca"])
    r.ca_pem = files["ca"].read_bytes()
    yield r
    r.stop()


@pytest.fixture
def idle(workers):
    yield workers
    wait_until(workers.idle, 5, f"the pools are not idle: {workers.stats()}")


@pytest.fixture(scope="module")
def llm(workers):
    engine = LLM(workers.model_dir, kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN)
    yield engine
    engine.shutdown()


# ---- raw HTTP helpers --------------------------------------------------------------------------
def split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def request(address, method, path, body=None, headers=None, tls_ca: bytes | None = None):
    """(status, headers, body bytes); body: bytes as they are, anything else as JSON."""
    host, port = split(address)
    if tls_ca is not None:
        ctx = ssl.create_default_context(cadata=tls_ca.decode())
        conn = http.client.HTTPSConnection(host, port, timeout=TIMEOUT, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    try:
        conn.request(method, path, body=data, headers=all_headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def post(router_, path, body, **kwargs):
    return request(router_.http_address, "POST", path, body, **kwargs)


def assert_error(status, body: bytes, want_status: int, param="any") -> dict:
    """The OpenAI error object and the status; returns the error."""
    assert status == want_status, (status, body[:500])
    doc = json.loads(body)
    assert set(doc) == {"error"}, doc
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param != "any":
        assert err["param"] == param, err
    return err


def serves(router_) -> None:
    """A small completion still works (after bad input)."""
    status, _, body = post(
        router_, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}
    )
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 2


def sse_events(body: bytes) -> list:
    """The events of an SSE body, checked against OpenAI's framing: `data: <json>\\n\\n` each,
    the last one `data: [DONE]`."""
    text = body.decode()
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    parts = text.split("\n\n")
    assert parts[-1] == ""
    events = []
    for part in parts[:-1]:
        assert part.startswith("data: ") and "\n" not in part, part
        payload = part.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    return events[:-1]


# ---- bad input: the OpenAI error shape, the right status, and the server keeps serving --------
GOOD = {"model": MODEL, "prompt": "t5 t6", "max_tokens": 2}
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "max_tokens": 2}
C, CHAT = "/v1/completions", "/v1/chat/completions"
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
    ("model-missing", C, {"prompt": "t5"}, 400, "model"),
    ("unknown-field", C, {**GOOD, "frobnicate": 1}, 400, "frobnicate"),
    ("unsupported-vllm-field", C, {**GOOD, "use_beam_search": True}, 400, "use_beam_search"),
    ("temperature-too-high", C, {**GOOD, "temperature": 3.0}, 400, "temperature"),
    ("temperature-negative", C, {**GOOD, "temperature": -0.1}, 400, "temperature"),
    ("top-p-zero", C, {**GOOD, "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", C, {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("presence-penalty", C, {**GOOD, "presence_penalty": 5}, 400, "presence_penalty"),
    ("repetition-penalty-zero", C, {**GOOD, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("max-tokens-zero", C, {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-negative", C, {**GOOD, "max_tokens": -1}, 400, "max_tokens"),
    ("max-tokens-over-model-len", C, {**GOOD, "max_tokens": 100_000}, 400, None),
    ("min-tokens-over-max", C, {**GOOD, "min_tokens": 5}, 400, None),
    ("n-zero", C, {**GOOD, "n": 0}, 400, "n"),
    ("n-too-many", C, {**GOOD, "n": 65}, 400, "n"),
    ("nan", C, b'{"model": "tiny", "prompt": "t5", "temperature": NaN}', 400, "temperature"),
    ("infinity", C, b'{"model": "tiny", "prompt": "t5", "top_p": Infinity}', 400, "top_p"),
    ("overflow-to-inf", C, b'{"model": "tiny", "prompt": "t5", "min_p": 1e999}', 400, "min_p"),
    ("seed-past-int64", C, {**GOOD, "seed": 2**64}, 400, "seed"),
    ("stop-empty-string", C, {**GOOD, "stop": [""]}, 400, "stop"),
    ("stop-too-many", C, {**GOOD, "stop": [f"s{i}" for i in range(65)]}, 400, "stop"),
    ("stop-too-long", C, {**GOOD, "stop": "x" * 513}, 400, "stop"),
    ("stop-token-past-vocab", C, {**GOOD, "stop_token_ids": [300]}, 400, None),
    ("token-id-negative", C, {**GOOD, "prompt": [5, -1]}, 400, "prompt"),
    ("token-id-past-vocab", C, {**GOOD, "prompt": [5, 256]}, 400, None),
    ("prompt-empty", C, {**GOOD, "prompt": ""}, 400, None),
    ("prompt-too-long", C, {**GOOD, "prompt": [5] * MAX_MODEL_LEN}, 400, None),
    ("text-too-long", C, {**GOOD, "prompt": "t5 " * 5000}, 400, "prompt"),
    (
        "chat-too-long",
        CHAT,
        {**GOOD_CHAT, "messages": [{"role": "user", "content": "é" * 100_000}]},
        400,
        "messages",
    ),
    ("two-prompts", C, {**GOOD, "prompt": ["t5", "t6"]}, 400, "prompt"),
    ("logprobs-alternatives", C, {**GOOD, "logprobs": 5}, 400, "logprobs"),
    ("echo", C, {**GOOD, "echo": True}, 400, "echo"),
    ("stream-options-without-stream", C, {**GOOD, "stream_options": {}}, 400, None),
    (
        "continuous-usage",
        C,
        {**GOOD, "stream": True, "stream_options": {"continuous_usage_stats": True}},
        400,
        "stream_options.continuous_usage_stats",
    ),
    ("unknown-model", C, {**GOOD, "model": "gpt-5"}, 404, None),
    ("chat-unknown-model", CHAT, {**GOOD_CHAT, "model": "nope"}, 404, None),
    (
        "chat-bad-role",
        CHAT,
        {**GOOD_CHAT, "messages": [{"role": "tool", "content": "x"}]},
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
        "messages[0].content",
    ),
    (
        "chat-top-logprobs",
        CHAT,
        {**GOOD_CHAT, "logprobs": True, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    ("chat-tools", CHAT, {**GOOD_CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    (
        "chat-json-mode",
        CHAT,
        {**GOOD_CHAT, "response_format": {"type": "json_object"}},
        400,
        "response_format",
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
    from router import http_api

    def fail(finish):
        raise http_api.ApiError(500, "injected", "server_error")

    monkeypatch.setattr(http_api, "finish_reason", fail)
    status, _, body = post(router, C, {**GOOD, "stream": True})
    assert status == 200
    events = sse_events(body)
    assert set(events[-1]) == {"error"} and events[-1]["error"]["message"] == "injected"
    monkeypatch.undo()
    serves(router)


# ---- the openai client -------------------------------------------------------------------------
def client(router_, key="unused", **kwargs):
    return openai.OpenAI(
        base_url=f"http://{router_.http_address}/v1",
        api_key=key,
        max_retries=0,
        timeout=TIMEOUT,
        **kwargs,
    )


def eos_ignored(temperature: float = 0, **kwargs) -> dict:
    """create()'s arguments for MODEL with EOS ignored (a request runs to its token limit), greedy
    unless `temperature` says otherwise, and `kwargs`."""
    return dict(model=MODEL, temperature=temperature, extra_body={"ignore_eos": True}, **kwargs)


def test_openai_completions_greedy_equals_engine_llm(router, idle, llm):
    prompt = random_prompts([11], seed=21)[0]
    want = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    c = client(router)
    greedy = eos_ignored(prompt=prompt, max_tokens=10)
    got = c.completions.create(**greedy)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (11, 10)
    pieces, usage = [], None
    for chunk in c.completions.create(
        **greedy, stream=True, stream_options={"include_usage": True}
    ):
        pieces += [ch.text for ch in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == want.text and usage.completion_tokens == 10


def test_openai_chat_greedy_equals_engine_llm(router, idle, llm):
    messages = [
        {"role": "system", "content": "t10 t11"},
        {"role": "user", "content": "t5 t9 t200"},
    ]
    want = llm.chat(
        messages, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False
    )[0]
    c = client(router)
    greedy = eos_ignored(messages=messages)
    got = c.chat.completions.create(**greedy, max_tokens=9)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == 9
    stream = c.chat.completions.create(**greedy, max_completion_tokens=9, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == want.outputs[0].text
    # without max_tokens, a chat runs until the context is full (OpenAI's and vLLM's default)
    long = c.chat.completions.create(**greedy)
    assert long.choices[0].finish_reason == "length"
    assert long.usage.prompt_tokens + long.usage.completion_tokens == MAX_MODEL_LEN


def test_openai_stop_string(router, idle, llm):
    prompt = random_prompts([8], seed=5)[0]
    base = (
        llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    words = base.split()
    stop = f"{words[2]} {words[3]}"
    c = client(router)
    got = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[stop, "t999"]
    )
    assert got.choices[0].finish_reason == "stop" and stop not in got.choices[0].text
    assert base.startswith(got.choices[0].text) and got.choices[0].text
    messages = [{"role": "user", "content": "t5"}]
    chat_text = (
        llm.chat(
            messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    stop = " ".join(chat_text.split()[1:3])
    chat = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stop=stop,
        extra_body={"include_stop_str_in_output": True, "ignore_eos": True},
    )
    assert chat.choices[0].finish_reason == "stop"
    assert chat.choices[0].message.content.endswith(stop) and chat_text.startswith(
        chat.choices[0].message.content
    )


def test_openai_seed_same_seed_same_text(router, idle):
    c = client(router)

    def run(seed):
        args = eos_ignored(prompt="t5 t9", max_tokens=12, temperature=1.0, seed=seed)
        return c.completions.create(**args).choices[0].text

    first = run(1234)
    assert run(1234) == first
    assert run(4321) != first  # the seed matters: 12 tokens at temperature 1 over 256 ids


def test_openai_logprobs_through_a_colocated_router(colocated, idle, llm):
    """Sampled-token logprobs: completions (logprobs=0) and chat (logprobs=true), equal to the
    engine's own."""
    prompt = random_prompts([6], seed=8)[0]
    want = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=True),
        use_tqdm=False,
    )[0].outputs[0]
    c = client(colocated)
    got = c.completions.create(**eos_ignored(prompt=prompt, max_tokens=5, logprobs=0))
    lp = got.choices[0].logprobs
    tokenizer = colocated.servicer.tokenizer
    assert got.choices[0].text == want.text
    assert lp.tokens == [tokenizer.decode([t]) for t in want.token_ids]  # each token alone
    assert lp.token_logprobs == pytest.approx(list(want.logprobs), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chat = c.chat.completions.create(
        **eos_ignored(messages=[{"role": "user", "content": "t5"}], max_tokens=4, logprobs=True)
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(t.logprob <= 0 and t.top_logprobs == [] for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)


def test_openai_logprobs_disaggregated(router, idle):
    got = client(router).completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0, logprobs=0
    )
    assert len(got.choices[0].logprobs.token_logprobs) == 4


def test_openai_n_2(router, idle):
    """n=2 through the cluster: two choices with their own index, in the whole response and in
    the stream; each sequence seeded differently."""
    two = eos_ignored(n=2, max_tokens=6, temperature=1.0, seed=7)
    got = client(router).completions.create(prompt="t5 t9", **two)
    assert sorted(ch.index for ch in got.choices) == [0, 1]
    assert all(ch.text and ch.finish_reason == "length" for ch in got.choices)
    want_prompt = len(router.servicer.tokenizer.encode("t5 t9"))
    assert got.usage.completion_tokens == 12 and got.usage.prompt_tokens == want_prompt
    assert got.choices[0].text != got.choices[1].text  # seeded per sequence, not copies
    stream = client(router).chat.completions.create(
        messages=[{"role": "user", "content": "t5"}], stream=True, **two
    )
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert reasons == {0: "length", 1: "length"} and all(texts.values())


def test_openai_errors_are_the_client_exceptions(router):
    c = client(router)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-5", prompt="t5")
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="t5", temperature=9)
    assert e.value.body["param"] == "temperature"


# ---- a client that disconnects ---------------------------------------------------------------
def post_raw_completion(router, seed: int, **extra) -> socket.socket:
    """A raw socket that has sent a completion (a 40-token prompt, decoding until the context is
    full) and reads nothing yet."""
    host, port = split(router.http_address)
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": random_prompts([40], seed=seed)[0],
            "max_tokens": MAX_MODEL_LEN - 41,
            "temperature": 0,
            "ignore_eos": True,
            **extra,
        }
    ).encode()
    s = socket.create_connection((host, port), timeout=TIMEOUT)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return s


def wait_kv_freed_by_abort(idle, aborted) -> None:
    wait_until(
        lambda: any(reason == "aborted by the router" for _, reason in aborted) and idle.idle(),
        1.0,
        f"KV still held after the client left: {idle.stats()}",
    )


def test_client_disconnect_mid_stream_frees_kv_on_both_pools_within_1s(router, idle, monkeypatch):
    aborted = record_aborts(idle.decode, monkeypatch)
    s = post_raw_completion(router, seed=4, stream=True)
    got = b""
    while got.count(b"data: ") < 2:  # the stream is running: two tokens arrived
        got += s.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
    d, _ = idle.stats()
    assert d.num_running == 1 and d.num_free_blocks < d.num_total_blocks
    s.close()
    wait_kv_freed_by_abort(idle, aborted)


def test_client_disconnect_before_a_whole_response_frees_kv_within_1s(router, idle, monkeypatch):
    """Without stream, nothing is sent until the end: the front notices the client leaving by
    the connection itself and cancels the call as well."""
    aborted = record_aborts(idle.decode, monkeypatch)
    s = post_raw_completion(router, seed=6)
    wait_until(lambda: idle.stats()[0].num_running == 1, 5, "the request is decoding")
    s.close()
    wait_kv_freed_by_abort(idle, aborted)


def test_concurrent_requests_on_one_front(router, idle, llm):
    prompts = random_prompts([5, 9, 13, 17], seed=31)
    want = [
        o.outputs[0].text
        for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
        )
    ]
    results = run_in_threads(
        lambda i: client(router).completions.create(
            prompt=prompts[i % 4], stream=bool(i % 2), **eos_ignored(max_tokens=6)
        ),
        8,
    )
    for i in range(8):
        r = results[i]
        text = r.choices[0].text if not i % 2 else "".join(ch.choices[0].text for ch in r)
        assert text == want[i % 4]


# ---- API keys and HTTPS ------------------------------------------------------------------------
def test_keys_on_http_over_https(secured, idle, caplog):
    caplog.set_level(logging.DEBUG)
    ca = secured.ca_pem
    assert secured.http.scheme == "https"
    cases = [
        ({}, 401),
        ({"Authorization": f"Bearer {WRONG}"}, 401),
        ({"Authorization": f"Basic {KEY}"}, 401),
        ({"Authorization": "Bearer"}, 401),
        ({"Authorization": f"Bearer {KEY}"}, 200),
        ({"Authorization": f"bearer {KEY2}"}, 200),
    ]
    for headers, want in cases:
        status, resp_headers, body = post(secured, C, GOOD, headers=headers, tls_ca=ca)
        if want == 401:
            err = assert_error(status, body, 401)
            assert err["code"] == "invalid_api_key" and resp_headers["www-authenticate"] == "Bearer"
            assert KEY not in body.decode() and WRONG not in body.decode()
        else:
            assert status == 200, body
    # /health stays open; /metrics and /v1/models need a key
    assert request(secured.http_address, "GET", "/health", tls_ca=ca)[0] == 200
    for path in ("/metrics", "/v1/models"):
        status, _, body = request(secured.http_address, "GET", path, tls_ca=ca)
        assert_error(status, body, 401)
        auth = {"Authorization": f"Bearer {KEY}"}
        assert request(secured.http_address, "GET", path, headers=auth, tls_ca=ca)[0] == 200
    # plaintext HTTP to the HTTPS port gets nowhere
    with pytest.raises((http.client.HTTPException, OSError)):
        request(secured.http_address, "GET", "/health")
    assert KEY not in caplog.text and KEY2 not in caplog.text and WRONG not in caplog.text


def test_keys_on_grpc(secured, idle, caplog):
    caplog.set_level(logging.DEBUG)
    creds = grpc.ssl_channel_credentials(root_certificates=secured.ca_pem)
    request_ = pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=[5, 6, 7]),
        sampling=pdserve_pb2.SamplingParams(temperature=0, max_tokens=3),
    )
    with grpc.secure_channel(secured.address, creds) as channel:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        for metadata in ((), (("authorization", f"Bearer {WRONG}"),), (("authorization", KEY),)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request_, metadata=metadata, timeout=TIMEOUT))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert KEY not in e.value.details() and WRONG not in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                stub.ListModels(pdserve_pb2.ListModelsRequest(), metadata=metadata, timeout=TIMEOUT)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for key in (KEY, KEY2):
            out = list(
                stub.Generate(
                    request_, metadata=(("authorization", f"Bearer {key}"),), timeout=TIMEOUT
                )
            )
            assert out[-1].finish.usage.completion_tokens == 3
        # health stays open without a key
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert "API key" in caplog.text  # the refusal was logged, the keys were not
    assert KEY not in caplog.text and KEY2 not in caplog.text and WRONG not in caplog.text


def test_openai_client_over_https_with_a_key(secured, idle):
    http_client = openai.DefaultHttpx2Client(
        verify=ssl.create_default_context(cafile=secured.ca_file)
    )
    c = openai.OpenAI(
        base_url=f"https://{secured.http_address}/v1",
        api_key=KEY,
        max_retries=0,
        timeout=TIMEOUT,
        http_client=http_client,
    )
    assert [m.id for m in c.models.list()] == [MODEL]
    got = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "t5"}], max_tokens=3
    )
    assert got.usage.completion_tokens == 3
    text = "".join(
        ch.choices[0].text
        for ch in c.completions.create(model=MODEL, prompt="t5", max_tokens=3, stream=True)
        if ch.choices
    )
    assert isinstance(text, str)
    bad = openai.OpenAI(
        base_url=f"https://{secured.http_address}/v1",
        api_key=WRONG,
        max_retries=0,
        timeout=TIMEOUT,
        http_client=openai.DefaultHttpx2Client(
            verify=ssl.create_default_context(cafile=secured.ca_file)
        ),
    )
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="t5", max_tokens=2)
    assert repr(secured.config).count(KEY) == 0 and "ClientKeys(2 keys)" in repr(
        secured.http.settings.keys
    )


# ---- overload and no workers: 429 and 503 ------------------------------------------------------
def test_a_full_router_answers_429_with_retry_after(workers, idle):
    full = workers.router(max_inflight=1)
    host, port = split(full.http_address)
    body = json.dumps(
        {**GOOD, "max_tokens": MAX_MODEL_LEN - 10, "ignore_eos": True, "stream": True}
    ).encode()
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            got = b""
            while b"data: " not in got:  # the one admitted request is streaming
                got += s.recv(4096)
            status, headers, resp = post(full, C, GOOD)
            err = assert_error(status, resp, 429)
            assert err["code"] == "rate_limit_exceeded" and headers["retry-after"] == "1"
    finally:
        full.stop()


def test_no_workers_is_503_and_health_says_so(workers):
    empty = Router(
        RouterConfig(
            model=workers.model_dir, model_id=MODEL, max_model_len=MAX_MODEL_LEN, http_port=0
        )
    ).start()
    private_dir = empty.http._dir
    try:
        status, _, body = request(empty.http_address, "GET", "/health")
        assert "worker" in assert_error(status, body, 503)["message"]
        status, headers, body = post(empty, C, GOOD)
        assert_error(status, body, 503) and headers["retry-after"] == "1"
    finally:
        empty.stop()
    import os

    assert not os.path.exists(private_dir)  # the Unix socket's directory goes with the router
    with pytest.raises(OSError):
        request(empty.http_address, "GET", "/health")


def test_https_with_client_certificates_like_the_grpc_port(workers, tmp_path):
    """client_tls with a CA: like the gRPC port, HTTPS then needs a client certificate it
    signed (the test's certificate serves as both)."""
    files = tls_files(tmp_path)
    ca, cert, key = (files[k].read_bytes() for k in ("ca", "cert", "key"))
    mutual = workers.router(client_tls=TLSConfig(ca, cert, key))
    try:
        host, port = split(mutual.http_address)
        anonymous = ssl.create_default_context(cafile=str(files["ca"]))
        with pytest.raises((ssl.SSLError, OSError, http.client.HTTPException)):
            conn = http.client.HTTPSConnection(host, port, timeout=TIMEOUT, context=anonymous)
            conn.request("GET", "/health")
            conn.getresponse().read()
        known = ssl.create_default_context(cafile=str(files["ca"]))
        known.load_cert_chain(str(files["cert"]), str(files["key"]))
        conn = http.client.HTTPSConnection(host, port, timeout=TIMEOUT, context=known)
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(GOOD),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 2
        conn.close()
    finally:
        mutual.stop()


def test_an_http_port_in_use_fails_the_start_naming_it(workers, router):
    _, port = split(router.http_address)
    with pytest.raises(OSError, match=f"cannot listen for HTTP on 127.0.0.1:{port}"):
        workers.router(http_port=port)
    serves(router)  # the one listening there is untouched


def test_pdserve_generate_sends_the_key_from_the_environment(secured, idle, monkeypatch, capsys):
    from deploy.cli import main

    argv = ["generate", "t5 t6", "--router", secured.address, "--tls-ca", secured.ca_file]
    argv += ["--max-tokens", "2"]
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    assert main(argv) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("PDSERVE_API_KEY", KEY2)
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "2 generated" in err and KEY2 not in err


def test_pdserve_bench_sends_the_key_from_the_environment(workers, idle, monkeypatch):
    """The load generator behind `pdserve bench` reads PDSERVE_API_KEY like `pdserve generate`."""
    from deploy.tuning import loadgen

    keyed = workers.router(api_keys=(KEY,))
    try:
        monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
        with pytest.raises(loadgen.LoadgenError, match="UNAUTHENTICATED.*PDSERVE_API_KEY"):
            loadgen.model_card(keyed.address, MODEL)
        monkeypatch.setenv("PDSERVE_API_KEY", KEY)
        assert loadgen.model_card(keyed.address, MODEL).id == MODEL
    finally:
        keyed.stop()
