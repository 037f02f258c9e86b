"""`pdserve bench --backend openai --base-url URL` (tuning/http_load.py) against a real router's HTTP
front on the tiny model (one prefill and one decode worker in this process): every request
completes with exactly its output length and the summary counts them; the card's max_model_len
refuses a prompt up front; requests the server refuses are recorded with their HTTP status and the
run goes on; a server that answers /v1/models with 401 or 404 is one line and exit code 2. The
SSE parsing on canned bytes: tests/unit/test_bench_http_stream.py."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from helpers.http import KEY, MAX_MODEL_LEN, MODEL
from pdserve.cli import main

VOCAB = 256  # the tiny model's word-level vocabulary ("t0".."t255")


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    monkeypatch.setenv("PDSERVE_NO_PROGRESS", "1")
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)  # restored after: --api-key sets it


def bench(base_url: str, *argv: str) -> int:
    return main(["bench", "--backend", "openai", "--base-url", base_url, *argv])


def test_every_request_completes_with_its_output_length(router, idle, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bench(
        f"http://{router.http_address}", "--vocab-size", str(VOCAB), "--prompt-len", "12",
        "--output-len", "7", "--num-requests", "6", "--max-concurrency", "3",
        "--out", str(out),
    )  # fmt: skip
    assert rc == 0
    assert "Successful requests:" in capsys.readouterr().out
    result = json.loads(out.read_text())
    reqs, s = result["requests"], result["summary"]
    assert [(r["error"], r["output_tokens"], r["finish_reason"]) for r in reqs] == [
        ("", 7, "length")
    ] * 6
    for r in reqs:
        assert 0 < r["ttft_s"] <= r["e2e_s"] and len(r["itl_s"]) <= 6
    assert (s["completed"], s["failed"], s["errors"]) == (6, 0, {})
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (6 * 12, 6 * 7)
    assert 1 <= s["max_concurrent_requests"] <= 3
    assert result["backend"] == "openai" and result["base_url"] == f"http://{router.http_address}"
    assert result["model"]["id"] == MODEL and result["model"]["max_model_len"] == MAX_MODEL_LEN


def test_a_prompt_over_the_cards_max_model_len_is_refused_before_any_request(router, capsys):
    argv = ["--vocab-size", str(VOCAB), "--prompt-len", str(MAX_MODEL_LEN), "--output-len", "1"]
    assert bench(f"http://{router.http_address}", *argv) == 2
    err = capsys.readouterr().err
    assert f"do not fit max_model_len {MAX_MODEL_LEN}" in err and err.count("\n") == 1


def test_requests_the_server_refuses_are_recorded_with_their_status_and_the_run_goes_on(
    router, idle, tmp_path, capsys
):
    # without --vocab-size the ids are drawn below 16000: the tiny vocabulary of 256 refuses every
    # prompt with a 400, each request is recorded as such, and nothing completes (exit 1)
    out = tmp_path / "r.json"
    argv = ["--prompt-len", "8", "--output-len", "3", "--num-requests", "4", "--out", str(out)]
    assert bench(f"http://{router.http_address}", *argv) == 1
    captured = capsys.readouterr()
    assert "--vocab-size" in captured.err and "BAD_REQUEST:" in captured.out
    result = json.loads(out.read_text())
    s = result["summary"]
    assert (s["completed"], s["failed"], s["errors"]) == (0, 4, {"BAD_REQUEST": 4})
    for r in result["requests"]:
        assert r["error"] == "BAD_REQUEST" and r["error_message"].startswith("HTTP 400: ")
    assert result["model"]["vocab_size"] is None and "--vocab-size" in result["prompt_token_ids"]


def test_a_key_the_server_wants_401_without_it_and_runs_with_it(workers, idle, capsys):
    keyed = workers.router(api_keys=(KEY,))
    try:
        url = f"http://{keyed.http_address}"
        argv = ["--vocab-size", str(VOCAB), "--prompt-len", "4", "--output-len", "2"]
        assert bench(url, *argv, "--num-requests", "2") == 2
        err = capsys.readouterr().err
        assert err.startswith("pdserve bench: ") and err.count("\n") == 1
        assert "401" in err and "--api-key" in err
        assert bench(url, *argv, "--num-requests", "2", "--api-key", KEY) == 0
    finally:
        keyed.stop()


class NotFound(http.server.BaseHTTPRequestHandler):
    """A server with no OpenAI API: 404 for everything."""

    def do_GET(self):
        body = b'{"detail": "Not Found"}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_server_without_v1_models_is_one_line_and_exit_2(capsys):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        assert bench(f"http://{host}:{port}", "--prompt-len", "4", "--output-len", "2") == 2
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert err.startswith("pdserve bench: ") and err.count("\n") == 1
    assert "404" in err and "/v1/models" in err and "--base-url" in err
