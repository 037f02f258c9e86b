"""POST /pause, POST /resume and GET /is_paused (router/pause.py, router/openai/pause.py) through
a router in front of a prefill and a decode worker on the tiny model: "abort" ends a running
request with finish_reason "abort" and answers once no worker holds it; "wait" answers only after
the running request finished whole; a request sent while paused is held, not refused, and runs
on /resume; a wait that outlasts its timeout is a 504 that leaves the pause on; bad query values
are 400s naming their key; a router whose deployment did not turn the endpoints on answers 404,
and one with keys refuses a caller without one. The pools hold no KV after each test."""

from __future__ import annotations

import http.client
import json
import threading

import pytest

from helpers.http import (
    KEY,
    MODEL,
    Workers,
    assert_error,
    post,
    request,
    serves,
    split,
    sse_events,
)
from helpers.threads import wait_until

TIMEOUT_S = 60.0  # bounds on a loaded machine, never speed claims
# max_tokens long enough to be running when /pause arrives, a few ms after the router admits it
# (the tiny model decodes ~500 tokens in about a second here), within its 512 positions
LONG, SHORT = 500, 100


@pytest.fixture(scope="module", name="workers")
def fixture_workers(tiny_models, one_thread):
    src, _ = tiny_models("llama-gqa")
    w = Workers(src, max_model_len=512)
    yield w
    w.stop()


@pytest.fixture(scope="module", name="router")
def fixture_router(workers):
    r = workers.router(pause_endpoints=True, max_inflight=4)
    yield r
    r.stop()


@pytest.fixture(name="idle")
def fixture_idle(workers, router):
    yield workers
    post(router, "/resume", None)
    wait_until(workers.idle, 10, f"the pools are not idle: {workers.stats()}")


def _completion(router, max_tokens: int) -> tuple[threading.Thread, list]:
    """A completion of max_tokens (end-of-sequence ignored) on a thread: [(status, body)]."""
    out: list = []
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True}

    def run():
        status, _, raw = post(router, "/v1/completions", body)
        out.append((status, json.loads(raw)))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _running(router, n: int = 1) -> None:
    admission = router.servicer.admission
    wait_until(lambda: admission.running() == n, TIMEOUT_S, f"{n} request(s) admitted")


def _paused_gauge(router) -> float:
    status, _, raw = request(router.http_address, "GET", "/metrics")
    assert status == 200, raw
    (line,) = [x for x in raw.decode().splitlines() if x.startswith("pdserve:router_paused{")]
    return float(line.rsplit(" ", 1)[1])


def _is_paused(router) -> bool:
    status, _, raw = request(router.http_address, "GET", "/is_paused")
    assert status == 200, raw
    return json.loads(raw)["is_paused"]


def test_abort_ends_the_running_request_and_holds_the_next_until_resume(router, idle):
    assert _is_paused(router) is False
    t, out = _completion(router, LONG)
    _running(router)
    status, _, raw = post(router, "/pause", None)  # mode abort: vLLM's default
    assert status == 200, raw
    assert json.loads(raw) == {"status": "paused", "aborted": 1}
    assert router.servicer.admission.idle() and _is_paused(router) is True
    assert _paused_gauge(router) == 1.0
    t.join(TIMEOUT_S)
    ((status, doc),) = out
    assert status == 200, doc
    assert doc["choices"][0]["finish_reason"] == "abort", doc
    # what it had (none where the pause came before its first token), then the end
    assert doc["usage"]["completion_tokens"] < LONG, doc
    wait_until(idle.idle, 10, f"the aborted request's KV is still held: {idle.stats()}")

    held, held_out = _completion(router, 3)  # sent while paused: queued, not refused
    wait_until(lambda: router.servicer.admission.queued() == 1, TIMEOUT_S, "the request queued")
    held.join(0.3)
    assert held.is_alive() and held_out == []
    status, _, raw = post(router, "/resume", None)
    assert status == 200 and json.loads(raw) == {"status": "resumed"}, raw
    held.join(TIMEOUT_S)
    ((status, doc),) = held_out
    assert status == 200 and doc["usage"]["completion_tokens"] == 3, doc
    assert _is_paused(router) is False and _paused_gauge(router) == 0.0


def test_an_aborted_stream_ends_with_finish_reason_abort_and_done(router, idle):
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": LONG, "ignore_eos": True}
    conn = http.client.HTTPConnection(*split(router.http_address), timeout=TIMEOUT_S)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({**body, "stream": True}),
            {"Content-Type": "application/json"},
        )
        reply = conn.getresponse()
        assert reply.status == 200
        got = b""
        while b'"text":"' not in got:  # a token has streamed: the request is running
            more = reply.read1(4096)
            assert more, got
            got += more
        status, _, raw = post(router, "/pause?mode=abort", None)
        assert status == 200 and json.loads(raw)["aborted"] == 1, raw
        got += reply.read()
    finally:
        conn.close()
    events = sse_events(got)  # OpenAI's framing to the end: [DONE] last
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert reasons == ["abort"], events[-3:]
    assert len([e for e in events if e["choices"] and e["choices"][0]["text"]]) < LONG


def test_wait_answers_after_the_running_request_finished_whole(router, idle):
    t, out = _completion(router, SHORT)
    _running(router)
    status, _, raw = post(router, "/pause?mode=wait", None)
    assert status == 200 and json.loads(raw) == {"status": "paused", "aborted": 0}, raw
    assert router.servicer.admission.idle()
    t.join(TIMEOUT_S)
    ((status, doc),) = out
    assert status == 200 and doc["choices"][0]["finish_reason"] == "length", doc
    assert doc["usage"]["completion_tokens"] == SHORT
    # vLLM's deprecated spelling of mode=wait, on a pause already on
    status, _, raw = post(router, "/pause?wait_for_inflight_requests=true&clear_cache=false", None)
    assert status == 200, raw


def test_a_wait_past_its_timeout_is_504_and_stays_paused(router, idle):
    t, out = _completion(router, LONG)
    _running(router)
    status, _, raw = post(router, "/pause?mode=wait&timeout=0.05", None)
    err = assert_error(status, raw, 504)
    assert "still run" in err["message"] and "/resume" in err["message"], err
    assert _is_paused(router) is True
    status, _, raw = post(router, "/pause?mode=abort", None)  # from there: end it
    assert status == 200 and json.loads(raw)["aborted"] == 1, raw
    t.join(TIMEOUT_S)
    assert out[0][1]["choices"][0]["finish_reason"] == "abort"


@pytest.mark.parametrize(
    "query, param",
    [
        ("mode=keep", "mode"),
        ("mode=later", "mode"),
        ("timeout=0", "timeout"),
        ("timeout=nan", "timeout"),
        ("timeout=99999", "timeout"),
        ("clear_cache=perhaps", "clear_cache"),
        ("wait_for_inflight_requests=2", "wait_for_inflight_requests"),
    ],
)
def test_bad_query_values_are_400_naming_the_key_and_do_not_pause(router, idle, query, param):
    status, _, raw = post(router, f"/pause?{query}", None)
    err = assert_error(status, raw, 400, param)
    if query == "mode=keep":
        assert "abort" in err["message"] and "wait" in err["message"], err
    assert _is_paused(router) is False
    serves(router)


def test_a_foreign_web_pages_pause_is_refused_and_does_not_pause(router, idle):
    """/pause takes no body, so a page of any origin could send it without the browser's
    preflight: one whose Origin is not the front's own nor listed is a 403 (app.py)."""
    status, _, raw = request(
        router.http_address, "POST", "/pause", headers={"Origin": "http://evil.example"}
    )
    err = assert_error(status, raw, 403)
    assert err["code"] == "forbidden_origin", err
    assert _is_paused(router) is False
    serves(router)


def test_off_unless_the_deployment_turns_it_on_and_keys_are_checked(workers):
    plain = workers.router()
    keyed = workers.router(pause_endpoints=True, api_keys=(KEY,))
    try:
        for method, path in (("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused")):
            status, _, raw = request(plain.http_address, method, path)
            err = assert_error(status, raw, 404)
            assert "router.pause_endpoints" in err["message"], err
            status, _, raw = request(keyed.http_address, method, path)
            assert status == 401, raw
        status, _, raw = request(
            keyed.http_address, "GET", "/is_paused", headers={"Authorization": f"Bearer {KEY}"}
        )
        assert status == 200 and json.loads(raw) == {"is_paused": False}, raw
        assert not plain.servicer.admission.is_paused and not keyed.servicer.admission.is_paused
    finally:
        plain.stop()
        keyed.stop()
