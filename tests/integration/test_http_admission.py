"""Overload and the clients that probe it, served (router/admission.py, router/service.py,
router/openai/responses/stream.py) on the integration lane's tiny chat model: 70 concurrent
requests all served by a router with max_inflight=2 (they wait in its admission queue, which
pdserve:router_admission_wait_seconds shows); past max_queued a 429 and past max_queue_wait_s a
503, each with Retry-After; a client that disconnects while queued leaves the queue; vLLM's
continuous_usage_stats puts each choice's usage on every chunk; an assistant message with
tool_calls and no content is read. The slot the bound tests need taken is taken through the
router's own Admission (a call the test holds), so they do not depend on how fast a request
runs."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from helpers.http import (
    CHAT,
    GOOD,
    GOOD_CHAT,
    TIMEOUT,
    C,
    assert_error,
    post,
    split,
    sse_events,
)
from helpers.threads import run_in_threads, wait_until


@pytest.fixture(scope="module", name="small")
def fixture_small(workers):
    """A router that serves 2 requests at once and queues the rest."""
    r = workers.router(max_inflight=2, max_queued=256, max_queue_wait_s=120.0)
    yield r
    r.stop()


def _admission_waits(router_) -> tuple[float, float]:
    """(count, sum) of pdserve:router_admission_wait_seconds."""
    hist = router_.metrics.admission_wait
    samples = {s.name: s.value for m in hist.collect() for s in m.samples}
    return samples["pdserve:router_admission_wait_seconds_count"], samples[
        "pdserve:router_admission_wait_seconds_sum"
    ]


def test_70_concurrent_requests_are_all_served_with_max_inflight_2(small, idle):
    before, _ = _admission_waits(small)

    def one(i):
        body = {**GOOD, "prompt": [5 + i % 7, 6, 7], "max_tokens": 4, "ignore_eos": True}
        status, _, raw = post(small, C, body)
        return status, json.loads(raw)

    results = run_in_threads(one, 70, timeout=600)
    assert sorted(s for s, _ in results.values()) == [200] * 70, [
        r for s, r in results.values() if s != 200
    ][:3]
    assert all(doc["usage"]["completion_tokens"] == 4 for _, doc in results.values())
    count, waited = _admission_waits(small)
    assert count - before == 70 and waited > 0  # 68 of them could not start at once
    assert small.servicer.admission.queued() == 0


def test_past_max_queued_is_429_and_past_max_wait_is_503_with_retry_after(workers):
    r = workers.router(max_inflight=1, max_queued=1, max_queue_wait_s=0.5)
    admission = r.servicer.admission
    held = admission.enter()  # the test holds the one slot
    try:
        assert held.granted
        status, headers, raw = post(r, C, GOOD)  # queued, then waits max_queue_wait_s
        err = assert_error(status, raw, 503)
        assert "max_queue_wait_s=0.5" in err["message"]
        assert {k.lower(): v for k, v in headers.items()}["retry-after"] == "1"

    finally:
        admission.leave(held)
        r.stop()
    r = workers.router(max_inflight=1, max_queued=1, max_queue_wait_s=120.0)
    admission = r.servicer.admission
    held = admission.enter()
    try:
        assert held.granted
        queued = {}
        waiter = threading.Thread(target=lambda: queued.update(out=post(r, C, GOOD)))
        waiter.start()
        wait_until(lambda: admission.queued() == 1, TIMEOUT, "the first request is queued")
        status, headers, raw = post(r, C, GOOD)  # the queue is full: refused at once
        err = assert_error(status, raw, 429)
        assert "max_queued=1" in err["message"]
        assert {k.lower(): v for k, v in headers.items()}["retry-after"] == "1"
        admission.leave(held)  # the held slot goes to the queued request, which is served
        held = None
        waiter.join(TIMEOUT)
        assert queued["out"][0] == 200, queued
    finally:
        if held is not None:
            admission.leave(held)
        r.stop()


def test_a_client_gone_while_queued_leaves_the_queue(workers):
    r = workers.router(max_inflight=1, max_queued=4, max_queue_wait_s=600.0)
    admission = r.servicer.admission
    held = admission.enter()
    try:
        assert held.granted
        host, port = split(r.http_address)
        body = json.dumps(GOOD).encode()
        sock = socket.create_connection((host, port), timeout=TIMEOUT)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: admission.queued() == 1, TIMEOUT, "the request is queued")
        sock.close()
        wait_until(lambda: admission.queued() == 0, TIMEOUT, "the gone client left the queue")
    finally:
        admission.leave(held)
    try:
        status, _, raw = post(r, C, GOOD)  # the slot is free again: served at once
        assert status == 200, raw
        assert admission.running() == 0
    finally:
        r.stop()


@pytest.mark.parametrize("path", [C, CHAT], ids=["completions", "chat"])
def test_continuous_usage_is_on_every_chunk(router, idle, path):
    base = GOOD if path == C else GOOD_CHAT
    body = {
        **base,
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    status, _, raw = post(router, path, body)
    assert status == 200, raw
    *chunks, last = sse_events(raw)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    prompt = last["usage"]["prompt_tokens"]
    assert prompt > 0
    counts = []
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt
        assert usage["total_tokens"] == prompt + usage["completion_tokens"]
        counts.append(usage["completion_tokens"])
    assert counts == sorted(counts) and counts[-1] == 5  # the finish chunk: the choice's all


def test_assistant_tool_calls_without_content_are_read(router, idle):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for assistant in (
        {"role": "assistant", "tool_calls": [call]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ):
        messages = [
            {"role": "user", "content": "t5"},
            assistant,
            {"role": "tool", "tool_call_id": "c1", "content": "t6"},
        ]
        status, _, raw = post(router, CHAT, {**GOOD_CHAT, "messages": messages})
        assert status == 200, raw


def test_the_queue_serves_another_keys_request_ahead_of_a_flood(workers):
    """Fairness between tenants through the HTTP front: with API keys, a request of key B that
    arrives behind key A's queued flood is served first once a slot frees (B runs nothing, A
    does); without keys, the x-gateway-inference-fairness-id header makes the flows, and a
    malformed one is a 400 naming it."""
    key_a, key_b = "sk-flooding-tenant-01", "sk-quiet-tenant-0002"
    r = workers.router(
        max_inflight=1, max_queued=16, max_queue_wait_s=120.0, api_keys=(key_a, key_b)
    )
    try:
        _first_served_after_a_flood(
            r, {"Authorization": f"Bearer {key_a}"}, {"Authorization": f"Bearer {key_b}"}
        )
    finally:
        r.stop()
    r = workers.router(max_inflight=1, max_queued=16, max_queue_wait_s=120.0)
    admission = r.servicer.admission
    try:
        _first_served_after_a_flood(r, {}, {"x-gateway-inference-fairness-id": "user-b"})
        status, _, raw = post(r, C, GOOD, headers={"x-gateway-inference-fairness-id": "x" * 129})
        err = assert_error(status, raw, 400)
        assert "x-gateway-inference-fairness-id" in err["message"] and "128" in err["message"]
        assert admission.running() == 0 and admission.queued() == 0
    finally:
        r.stop()


def _first_served_after_a_flood(r, flood_headers: dict, quiet_headers: dict) -> None:
    """Holds the one slot as the flooding tenant, queues 4 of its requests and then one of the
    quiet tenant's, frees the slot: the quiet request is the first to finish."""
    from pdserve.router.service import flow_of

    admission = r.servicer.admission

    class Meta:  # the flow the flood's calls have: the test's held slot is one of them
        def invocation_metadata(self):
            return tuple((k.lower(), v) for k, v in flood_headers.items())

    held = admission.enter(flow=flow_of(Meta()))
    finished, lock = [], threading.Lock()

    def send(name, headers):
        status, _, raw = post(r, C, {**GOOD, "max_tokens": 2}, headers=headers)
        with lock:
            finished.append((name, status, raw[:200]))

    threads = []
    try:
        for i in range(4):
            threads.append(threading.Thread(target=send, args=(f"flood-{i}", flood_headers)))
            threads[-1].start()
        wait_until(lambda: admission.queued() == 4, TIMEOUT, "the flood is queued")
        threads.append(threading.Thread(target=send, args=("quiet", quiet_headers)))
        threads[-1].start()
        wait_until(lambda: admission.queued() == 5, TIMEOUT, "the quiet request is queued")
        assert admission.tenants_waiting() == (2 if "Authorization" in quiet_headers else 1)
    finally:
        admission.leave(held)
    for t in threads:
        t.join(TIMEOUT)
    assert all(status == 200 for _, status, _ in finished), finished
    assert [name for name, _, _ in finished][0] == "quiet", finished
