"""`pdserve bench --backend openai` (tuning/http_load.py) on canned bytes, no socket: the SSE
streams of pdserve's HTTP front and of vLLM read into a request's record (TTFT at the first chunk
with text or ids, one ITL gap per such chunk, output tokens from the usage chunk or else the
chunks, cached tokens, finish_reason), an HTTP error status or an error event recorded as a status
name and message, the request body and its key, the /v1/models card and its refusals, and bench's
options and result file over HTTP. Against a real router's HTTP front:
tests/integration/test_bench_http.py."""

from __future__ import annotations

import json
import threading

import pytest

from helpers.tuning import bench_args
from pdserve.tuning import bench, http_load, loadgen
from pdserve.tuning.metrics import RequestRecord
from pdserve.tuning.workload import RequestSpec


# ---- canned streams ------------------------------------------------------------------------------
class Clock:
    """The time the canned stream says it is: `timed` sets it before each line goes out."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def timed(self, events, end: float):
        """SSE lines of `events` [(time, payload dict or "[DONE]" or raw bytes)], each at its
        time; the stream closes at `end`."""
        for t, payload in events:
            self.now = t
            if isinstance(payload, bytes):
                yield payload
                continue
            data = payload if isinstance(payload, str) else json.dumps(payload)
            yield f"data: {data}\n".encode()
            yield b"\n"
        self.now = end


def chunk(text="", finish=None, ids=None, usage=None, choices=True) -> dict:
    """A completion chunk as pdserve and vLLM stream it (one choice, index 0)."""
    out = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    if choices:
        c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if ids is not None:
            c["token_ids"] = ids
        out["choices"] = [c]
    else:
        out["choices"] = []
    out["usage"] = usage
    return out


def usage(prompt, completion, cached=None) -> dict:
    u = {"prompt_tokens": prompt, "completion_tokens": completion}
    u["total_tokens"] = prompt + completion
    u["prompt_tokens_details"] = None if cached is None else {"cached_tokens": cached}
    return u


def read(events, end, start=0.5, output_len=4) -> RequestRecord:
    rec = RequestRecord(0, 0.0, 8, output_len)
    clock = Clock()
    http_load.read_stream(rec, clock.timed(events, end), start, clock=clock)
    return rec


def test_pdserves_stream_fills_the_record():
    # pdserve's front: a chunk per delta, the finish chunk with text "", the usage chunk (with the
    # cached tokens and pdserve's extension), then [DONE]
    last = chunk(choices=False, usage=usage(8, 4, cached=3))
    last["pdserve"] = {"request_id": "http-1", "timings": {}}
    events = [
        (1.0, chunk(" t5")),
        (1.5, chunk(" t6")),
        (2.5, chunk(" t7")),
        (2.75, chunk(" t8")),
        (2.8, chunk("", finish="length")),
        (2.9, last),
        (3.0, "[DONE]"),
    ]
    r = read(events, end=3.25)
    assert r.ok and r.finish_reason == "length"
    assert r.output_tokens == 4 and r.cached_prompt_tokens == 3
    assert r.ttft_s == pytest.approx(0.5)  # 1.0 - the send at 0.5
    assert r.itl_s == pytest.approx([0.5, 1.0, 0.25])  # one gap per chunk with text
    assert r.itl_per_token_s == pytest.approx([0.5, 1.0, 0.25])  # a token a chunk
    assert r.e2e_s == pytest.approx(3.0 - 0.5)  # [DONE]: the stream's end
    assert r.timings == {} and r.kv_transfer_bytes == 0  # gRPC's only


def test_vllms_stream_with_the_finish_on_the_last_text_chunk_and_no_cached_tokens():
    events = [
        (1.0, chunk("a")),
        (2.0, chunk("b")),
        (4.0, chunk("c", finish="length")),
        (4.5, chunk(choices=False, usage=usage(8, 3))),
        (4.5, "[DONE]"),
    ]
    r = read(events, end=5.0, output_len=3)
    assert r.ok and r.finish_reason == "length" and r.output_tokens == 3
    assert r.ttft_s == pytest.approx(0.5) and r.itl_s == pytest.approx([1.0, 2.0])
    # E2E ends with the stream ([DONE] at 4.5), as the gRPC path's ends with its Finish
    assert r.cached_prompt_tokens == 0 and r.tpot_s == pytest.approx((4.5 - 1.0) / 2)


def test_chunks_of_several_tokens_count_once_for_itl_and_the_usage_counts_the_tokens():
    # 7 tokens in 3 chunks (stream_interval, speculation): vLLM's ITL has 2 gaps
    events = [
        (1.0, chunk("ab", ids=[5, 6])),
        (2.0, chunk("cde", ids=[7, 8, 9])),
        (3.0, chunk("fg", ids=[10, 11], finish="length")),
        (3.0, chunk(choices=False, usage=usage(8, 7))),
    ]
    r = read(events, end=3.5, output_len=7)
    assert r.ok and r.output_tokens == 7
    assert r.itl_s == pytest.approx([1.0, 1.0])
    # with the ids each gap splits over its chunk's tokens: a 0 for the first chunk's second
    assert r.itl_per_token_s == pytest.approx([0.0, 1 / 3, 1 / 3, 1 / 3, 0.5, 0.5])
    assert r.e2e_s == pytest.approx(3.0)  # no [DONE]: the stream's close


def test_without_a_usage_chunk_the_chunks_are_counted():
    events = [(1.0, chunk("a")), (2.0, chunk("b")), (2.0, chunk("", finish="length"))]
    assert read(events, end=2.0, output_len=2).output_tokens == 2
    ids = [(1.0, chunk("ab", ids=[1, 2])), (2.0, chunk("c", ids=[3], finish="length"))]
    assert read(ids, end=2.0, output_len=3).output_tokens == 3


def test_the_per_token_split_stays_empty_when_the_chunks_tokens_are_unknown():
    # 5 tokens in 2 chunks without ids: no way to split each gap over its tokens
    events = [(1.0, chunk("ab")), (2.0, chunk("cde", finish="length"))]
    events.append((2.0, chunk(choices=False, usage=usage(8, 5))))
    r = read(events, end=2.0, output_len=5)
    assert r.ok and r.output_tokens == 5 and r.itl_s == pytest.approx([1.0])
    assert r.itl_per_token_s == []
    # a chunk of text with an empty id list says nothing of its tokens either
    events = [(1.0, chunk("ab", ids=[1, 2])), (2.0, chunk("c", ids=[], finish="stop"))]
    r = read(events + [(2.0, chunk(choices=False, usage=usage(8, 3)))], end=2.0)
    assert r.ok and r.output_tokens == 3 and r.itl_per_token_s == []


def test_comments_blank_lines_and_a_first_chunk_without_text_are_not_tokens():
    events = [
        (0.7, b": keep-alive\n"),
        (0.8, b"\n"),
        (0.9, chunk("")),  # a role or empty chunk: no text, no ids
        (1.0, chunk("a")),
        (2.0, chunk("b", finish="stop")),
    ]
    r = read(events, end=2.0, output_len=2)
    assert r.ok and r.finish_reason == "stop" and r.ttft_s == pytest.approx(0.5)
    assert r.itl_s == pytest.approx([1.0])


@pytest.mark.parametrize(
    ("error", "name"),
    [
        # pdserve's front: OpenAI's error object, code a string or null
        (
            {"message": "the decode pool is gone", "type": "server_error", "param": None,
             "code": None},
            "SERVER_ERROR",
        ),
        # vLLM's: the HTTP status as `code`
        (
            {"object": "error", "message": "the decode pool is gone", "type": "BadRequestError",
             "param": None, "code": 400},
            "BAD_REQUEST",
        ),
    ],
)  # fmt: skip
def test_an_error_event_mid_stream_is_recorded_with_its_code_and_message(error, name):
    events = [(1.0, chunk("a")), (1.5, {"error": error}), (1.5, "[DONE]")]
    r = read(events, end=2.0)
    assert not r.ok and r.error == name and r.error_message == "the decode pool is gone"
    assert r.output_tokens == 1 and r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s is None  # as a gRPC status mid-stream


def test_a_stream_without_a_finish_or_aborted_is_not_completed():
    r = read([(1.0, chunk("a")), (1.0, "[DONE]")], end=1.0)
    assert r.error == "NO_FINISH"
    r = read([(1.0, chunk("a")), (1.2, chunk("", finish="abort")), (1.2, "[DONE]")], end=1.2)
    assert r.error == "abort" and r.finish_reason == "abort"


# ---- the sender, on a fake connection ------------------------------------------------------------
class Response:
    def __init__(self, status=200, body=b"", lines=(), reason="OK", fail=None):
        self.status, self.reason, self.body = status, reason, body
        self.lines, self.fail = list(lines), fail

    def read(self):
        return self.body

    def __iter__(self):
        yield from self.lines
        if self.fail is not None:
            raise self.fail


class Server:
    """A fake server behind Target.connection: each request's (method, path, body, headers), and
    an answer per path (a Response, or a function of the body that gives one)."""

    def __init__(self, routes):
        self.routes, self.seen = routes, []
        self.lock = threading.Lock()

    def connection(self, timeout_s=None):
        server = self

        class Conn:
            def request(self, method, path, body=None, headers=None):
                with server.lock:
                    server.seen.append((method, path, body, dict(headers or {})))
                self.answer = server.routes[path]
                self.body = body

            def getresponse(self):
                a = self.answer
                return a(self.body) if callable(a) else a

            def close(self):
                pass

        return Conn()


def sse(*events) -> list[bytes]:
    return [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events]


def streamed(body: bytes) -> Response:
    """A completion of exactly max_tokens tokens, one chunk each, a usage chunk, [DONE]."""
    n = json.loads(body)["max_tokens"]
    chunks = [chunk(f" t{k}") for k in range(n - 1)] + [chunk(" t", finish="length")]
    return Response(lines=sse(*chunks, chunk(choices=False, usage=usage(4, n)), "[DONE]"))


def target(monkeypatch, server, url="http://h:8000/root", key=None) -> http_load.Target:
    if key is None:
        monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("PDSERVE_API_KEY", key)
    t = http_load.Target.of(url)
    monkeypatch.setattr(http_load.Target, "connection", lambda self, timeout_s: server.connection())
    return t


def send_one(t, output_len=3) -> RequestRecord:
    rec = RequestRecord(0, 0.0, 4, output_len)
    done = []
    body = http_load.request_body(RequestSpec(0.0, 4, output_len), [11, 12, 13, 14], "m")
    http_load.send(t, body, rec, 0.0, 10.0, lambda: done.append(1))
    assert done == [1]
    return rec


def test_the_request_is_vllms_token_id_completion_with_the_key_as_bearer(monkeypatch):
    server = Server({"/root/v1/completions": streamed})
    r = send_one(target(monkeypatch, server, key="sk-1"), output_len=3)
    assert r.ok and r.output_tokens == 3 and r.finish_reason == "length"
    [(method, path, body, headers)] = server.seen
    assert method == "POST" and path == "/root/v1/completions"
    assert headers["Authorization"] == "Bearer sk-1"
    assert json.loads(body) == {
        "model": "m",
        "prompt": [11, 12, 13, 14],
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_no_key_no_authorization_header(monkeypatch):
    server = Server({"/root/v1/completions": streamed})
    assert send_one(target(monkeypatch, server)).ok
    assert "Authorization" not in server.seen[0][3]


@pytest.mark.parametrize(
    ("status", "body", "name", "said"),
    [
        (429, b'{"error": {"message": "the router is full", "type": "rate_limit_error", '
              b'"param": null, "code": null}}', "TOO_MANY_REQUESTS", "HTTP 429: the router is full"),
        (400, b'{"object": "error", "message": "bad ids", "type": "BadRequestError", '
              b'"code": 400}', "BAD_REQUEST", "HTTP 400: bad ids"),
        (404, b'{"detail": "Not Found"}', "NOT_FOUND", "HTTP 404: Not Found"),
        (502, b"<html>\n bad\n gateway </html>", "BAD_GATEWAY", "HTTP 502: <html> bad gateway </html>"),
        (599, b"", "HTTP_599", "HTTP 599: "),
    ],
)  # fmt: skip
def test_an_http_error_status_is_recorded_as_its_name_and_message(
    monkeypatch, status, body, name, said
):
    server = Server({"/root/v1/completions": Response(status, body)})
    r = send_one(target(monkeypatch, server))
    assert (r.error, r.error_message) == (name, said)
    assert r.ttft_s is None and r.e2e_s is None and r.output_tokens == 0


def test_a_connection_failure_or_a_timeout_is_recorded_and_done_still_counts(monkeypatch):
    def refused(self, timeout_s):
        raise ConnectionRefusedError(111, "Connection refused")

    t = target(monkeypatch, Server({}))
    monkeypatch.setattr(http_load.Target, "connection", refused)
    r = send_one(t)
    assert r.error == "ConnectionRefusedError" and "refused" in r.error_message
    stalled = Response(lines=sse(chunk("a")), fail=TimeoutError("timed out"))
    r = send_one(target(monkeypatch, Server({"/root/v1/completions": stalled})))
    assert r.error == "TIMEOUT" and r.output_tokens == 1


def test_drive_load_runs_the_http_sender_under_its_semaphore(monkeypatch):
    server = Server({"/v1/completions": streamed})
    t = target(monkeypatch, server, url="http://h:8000")
    specs = [RequestSpec(0.0, 4, n) for n in (1, 2, 3, 4, 5, 6)]
    records, _ = http_load.run_load(t, specs, [[1, 2, 3, 4]] * 6, model="m", max_concurrency=2)
    assert [r.output_tokens for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r.ok for r in records) and len(server.seen) == 6


# ---- the model card ------------------------------------------------------------------------------
MODELS = json.dumps(
    {"object": "list", "data": [
        {"id": "base", "object": "model", "max_model_len": 256, "owned_by": "vllm"},
        {"id": "lora-a", "object": "model", "parent": "base"},
    ]}
).encode()  # fmt: skip


def test_the_card_is_the_first_or_the_named_one_and_the_vocabulary_is_a_safe_range(monkeypatch):
    t = target(monkeypatch, Server({"/root/v1/models": Response(body=MODELS)}))
    card = http_load.model_card(t)
    assert (card.id, card.max_model_len, card.vocab_size_given) == ("base", 256, False)
    assert card.vocab_size == http_load.FALLBACK_VOCAB <= 32000  # Llama 2's vocabulary holds it
    named = http_load.model_card(t, "lora-a", vocab_size=500)
    assert (named.id, named.max_model_len, named.vocab_size) == ("lora-a", None, 500)
    with pytest.raises(loadgen.LoadgenError, match="does not serve model 'x'; it serves base"):
        http_load.model_card(t, "x")


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (Response(401, b'{"error": {"message": "invalid API key", "type": "authentication_error",'
                       b' "param": null, "code": null}}', reason="Unauthorized"),
         "401 Unauthorized: invalid API key (no key was given: pass the server's API key with "
         "--api-key or set PDSERVE_API_KEY)"),
        (Response(404, b'{"detail":"Not Found"}', reason="Not Found"),
         "404 Not Found: Not Found (is it an OpenAI-compatible server?"),
        (Response(200, b'{"data": []}'), "serves no model"),
        (Response(200, b"<html>"), "did not answer OpenAI's model list"),
    ],
)  # fmt: skip
def test_a_card_that_cannot_be_read_is_one_line_naming_what_to_change(monkeypatch, answer, said):
    t = target(monkeypatch, Server({"/root/v1/models": answer}))
    with pytest.raises(loadgen.LoadgenError) as e:
        http_load.model_card(t)
    assert said in str(e.value) and "\n" not in str(e.value)


# ---- bench's options and result over HTTP --------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--backend", "openai", "--sessions", "2", "--turns", "2", "--message-len", "4",
          "--answer-len", "2"], "--sessions/--sessions-from run over the router's gRPC API only"),
        (["--base-url", "http://h:1", "--sessions-from", "mooncake"], "gRPC API only"),
        (["--backend", "pdserve-grpc", "--base-url", "http://h:1"], "--base-url: the openai"),
        (["--vocab-size", "100"], "--vocab-size: the openai backend's"),
        (["--base-url", "http://h:1", "--endpoint", "/v1/chat/completions"], "not chat"),
        (["--base-url", "http://h:1", "--vocab-size", "0"], "--vocab-size must be >= 1"),
        (["--base-url", "ftp://h:1"], "expected http[s]://HOST"),
        (["--base-url", "http://h:1", "--tls-ca", "ca.pem"], "need an https:// --base-url"),
        (["--base-url", "https://h:1", "--tls-server-name", "x"], "--tls-server-name"),
    ],
)  # fmt: skip
def test_what_the_http_mode_cannot_do_is_refused_in_one_line(argv, said, capsys):
    argv = argv + (
        ["--prompt-len", "4", "--output-len", "2"] if "--sessions" not in " ".join(argv) else []
    )
    assert bench.run(bench_args(*argv)) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1


def test_a_prompt_that_does_not_fit_the_cards_max_model_len_is_refused_up_front(
    monkeypatch, capsys
):
    server = Server({"/v1/models": Response(body=MODELS)})
    target(monkeypatch, server, url="http://h:8000")
    argv = ["--base-url", "http://h:8000", "--prompt-len", "250", "--output-len", "7"]
    assert bench.run(bench_args(*argv)) == 2
    assert "do not fit max_model_len 256" in capsys.readouterr().err
    assert [s[0] for s in server.seen] == ["GET"]  # nothing was sent


def test_a_run_over_http_writes_the_backend_the_url_and_how_the_ids_were_drawn(
    monkeypatch, tmp_path, capsys
):
    server = Server({"/v1/models": Response(body=MODELS), "/v1/completions": streamed})
    target(monkeypatch, server, url="http://h:8000")
    out = tmp_path / "r.json"
    argv = ["--base-url", "http://h:8000/", "--prompt-len", "8", "--output-len", "5",
            "--num-requests", "4", "--max-concurrency", "2", "--out", str(out),
            "--disable-tqdm"]  # fmt: skip
    assert bench.run(bench_args(*argv)) == 0
    captured = capsys.readouterr()
    assert "Serving Benchmark Result" in captured.out
    assert "below 16000" in captured.err and "--vocab-size" in captured.err
    result = json.loads(out.read_text())
    assert result["backend"] == result["endpoint_type"] == "openai"
    assert result["base_url"] == "http://h:8000" and result["endpoint"] == "/v1/completions"
    assert result["model"]["id"] == "base" and result["model"]["vocab_size"] is None
    assert "below 16000" in result["prompt_token_ids"]
    s = result["summary"]
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (4, 0, 20)
    assert s["total_input_tokens"] == 32 and s["max_concurrent_requests"] <= 2
    assert [r["output_tokens"] for r in result["requests"]] == [5] * 4
    bodies = [json.loads(b) for m, _, b, _ in server.seen if m == "POST"]
    assert [b["model"] for b in bodies] == ["base"] * 4  # the card's id, no --model given
    ids = [i for b in bodies for i in b["prompt"]]
    assert len(ids) == 32 and max(ids) < http_load.FALLBACK_VOCAB


def test_vocab_size_bounds_the_prompt_ids_and_is_recorded(monkeypatch, tmp_path, capsys):
    server = Server({"/v1/models": Response(body=MODELS), "/v1/completions": streamed})
    target(monkeypatch, server, url="http://h:8000")
    out = tmp_path / "r.json"
    argv = [
        "--base-url",
        "http://h:8000",
        "--vocab-size",
        "300",
        "--prompt-len",
        "64",
        "--output-len",
        "2",
        "--num-requests",
        "3",
        "--out",
        str(out),
        "--disable-tqdm",
    ]
    assert bench.run(bench_args(*argv)) == 0
    assert "below" not in capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["model"]["vocab_size"] == 300 and "300" in result["prompt_token_ids"]
    ids = [i for m, _, b, _ in server.seen if m == "POST" for i in json.loads(b)["prompt"]]
    assert len(ids) == 3 * 64 and max(ids) < 300


def test_a_sweep_over_http_runs_each_rate_on_the_server(monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    server = Server({"/v1/models": Response(body=MODELS), "/v1/completions": streamed})
    target(monkeypatch, server, url="http://h:8000")
    out = tmp_path / "sweep.json"
    argv = ["--base-url", "http://h:8000", "--vocab-size", "300", "--prompt-len", "4",
            "--output-len", "2", "--num-requests", "3", "--sweep-rates", "50,100",
            "--slo", "ttft=10s,tpot=10s", "--out", str(out), "--disable-tqdm"]  # fmt: skip
    assert bench.run(bench_args(*argv)) == 0
    result = json.loads(out.read_text())
    assert [r["completed"] for r in result["runs"]] == [3, 3]
    assert sum(m == "POST" for m, *_ in server.seen) == 6 and result["backend"] == "openai"
