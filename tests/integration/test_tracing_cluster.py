"""One OpenTelemetry trace per request across the router and its workers (issue #51, must-show
a): an in-process OTLP/gRPC collector receives the spans of a request sent with a client's
traceparent through a 1P+1D cluster (router, prefill worker and decode worker, each with its own
service name) under the client's trace id, with the KV hand-off on both sides, one root under the
client's span, and every span's parent inside the trace; a request without a traceparent starts
a trace of its own; a malformed one is ignored."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest

pytest.importorskip("opentelemetry.sdk", reason="tracing needs the otel extra")

from opentelemetry.proto.collector.trace.v1 import (  # noqa: E402
    trace_service_pb2,
    trace_service_pb2_grpc,
)

from helpers.worker import start_decode, start_prefill, start_router, stop_all  # noqa: E402
from pdserve.protos.pdserve.v1 import (  # noqa: E402
    pdserve_pb2,
    pdserve_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
GREEDY = pdserve_pb2.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


traced_endpoints: dict[str, None] = {}  # the module collector's endpoint, for a second cluster


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """The OTLP/gRPC trace endpoint: every span it receives as (service, span)."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next(
                    a.value.string_value for a in rs.resource.attributes if a.key == "service.name"
                )
                for ss in rs.scope_spans:
                    self.spans += [(service, span) for span in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_hex: str):
        with self.lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id.hex() == trace_hex]


@pytest.fixture(scope="module")
def traced(model_dir):
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    traced_endpoints[endpoint] = None
    decode = start_decode(model_dir, otlp_traces_endpoint=endpoint)
    prefill = start_prefill(model_dir, otlp_traces_endpoint=endpoint)
    router = start_router(model_dir, decode, prefill, otlp_traces_endpoint=endpoint, http_port=0)
    try:
        tracings = [
            router.tracing,
            prefill.parts["prefill"].servicer.tracing,
            decode.parts["decode"].servicer.tracing,
        ]
        assert all(t is not None for t in tracings)
        collector.prefill_address = prefill.address  # for a call straight to the worker
        yield collector, router, tracings
    finally:
        stop_all([], router, prefill, decode)
        server.stop(0)


def _generate(router, prompt, metadata=()):
    with grpc.insecure_channel(router.address) as channel:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        request = pdserve_pb2.GenerateRequest(
            token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=GREEDY
        )
        return list(stub.Generate(request, metadata=metadata, timeout=30))


def _spans(collector, tracings, trace_hex, want: int, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        for t in tracings:
            t.flush()
        got = collector.of_trace(trace_hex)
        if len(got) >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_one_trace_across_router_prefill_and_decode(traced):
    collector, router, tracings = traced
    responses = _generate(
        router, list(range(3, 40)), metadata=(("traceparent", f"00-{TRACE}-{CLIENT_SPAN}-01"),)
    )
    assert responses[-1].HasField("finish")
    # llm_request (+ admission, reserve, decode stream, prefill call), prefill (+ queue,
    # compute, kv.push), decode, kv.receive
    spans = _spans(collector, tracings, TRACE, 11)
    by_name = {s.name: (svc, s) for svc, s in spans}
    assert {svc for svc, _ in spans} == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    for name, service in (
        ("llm_request", "pdserve-router"),
        ("admission", "pdserve-router"),
        ("reserve", "pdserve-router"),
        ("decode stream", "pdserve-router"),
        ("prefill call", "pdserve-router"),
        ("prefill", "pdserve-prefill"),
        ("prefill.compute", "pdserve-prefill"),
        ("kv.push", "pdserve-prefill"),
        ("decode", "pdserve-decode"),
        ("kv.receive", "pdserve-decode"),
    ):
        assert by_name.get(name, (None,))[0] == service, (name, sorted(by_name))
    ids = {s.span_id for _, s in spans}
    roots = [s for _, s in spans if s.parent_span_id.hex() == CLIENT_SPAN]
    assert [s.name for s in roots] == ["llm_request"]  # one root, under the client's span
    assert all(s.parent_span_id in ids for _, s in spans if s is not roots[0])
    root = roots[0]
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["gen_ai.usage.completion_tokens"].int_value == 6
    assert attrs["gen_ai.latency.time_to_first_token"].double_value > 0
    push = {a.key: a.value for a in by_name["kv.push"][1].attributes}
    assert push["pdserve.kv_bytes"].int_value > 0
    # the worker's prefill span sits under the router's span of its call
    prefill_span = by_name["prefill"][1]
    assert prefill_span.parent_span_id == by_name["prefill call"][1].span_id
    assert [e.name for e in by_name["decode"][1].events] == ["commit"]
    # the KV frames carried the prefill span's context: kv.receive links to it
    links = [(link.trace_id.hex(), link.span_id) for link in by_name["kv.receive"][1].links]
    assert links == [(TRACE, prefill_span.span_id)]
    # the workers' spans sit inside the request's time
    for _, s in spans:
        assert root.start_time_unix_nano <= s.start_time_unix_nano <= root.end_time_unix_nano


def test_a_refused_prefill_call_ends_its_span_with_the_status(traced):
    """A Prefill call the worker refuses (no reservation) still leaves its span, in error, with
    the status it was refused with."""
    collector, _, tracings = traced
    trace = "5" * 32
    with grpc.insecure_channel(collector.prefill_address) as channel:
        stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Prefill(
                worker_pb2.PrefillRequest(request_id="no-reservation", prompt_token_ids=[3, 4]),
                metadata=(("traceparent", f"00-{trace}-{CLIENT_SPAN}-01"),),
                timeout=30,
            )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [(service, span)] = _spans(collector, tracings, trace, 1)
    assert (service, span.name) == ("pdserve-prefill", "prefill")
    assert span.status.code == span.status.STATUS_CODE_ERROR
    assert span.status.message.startswith("INVALID_ARGUMENT: reservation must be set")


def test_no_traceparent_starts_a_trace_and_a_bad_one_is_ignored(traced):
    collector, router, tracings = traced
    before = {s.trace_id for _, s in collector.spans}
    _generate(router, list(range(50, 70)))
    _generate(router, list(range(80, 99)), metadata=(("traceparent", "00-zz-nonsense-01"),))
    deadline = time.monotonic() + 20
    while True:
        for t in tracings:
            t.flush()
        roots = [
            s for _, s in collector.spans if s.name == "llm_request" and s.trace_id not in before
        ]
        if len(roots) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(roots) == 2 and len({s.trace_id for s in roots}) == 2
    assert all(not s.parent_span_id for s in roots)  # new traces: no parent


def test_a_resume_after_a_decode_worker_dies_is_in_the_same_trace(model_dir, traced):
    collector, _, _ = traced
    endpoint = next(iter(traced_endpoints))
    decodes = [
        start_decode(model_dir, worker_id=f"d{i}", otlp_traces_endpoint=endpoint, stop_grace_s=0)
        for i in (0, 1)
    ]
    for d in decodes:  # slowed, so the test stops the worker mid-stream
        step = d.loop.engine.step
        d.loop.engine.step = lambda step=step: (time.sleep(0.02), step())[1]
    prefill = start_prefill(model_dir, otlp_traces_endpoint=endpoint)
    router = start_router(
        model_dir, decodes, prefill, otlp_traces_endpoint=endpoint, worker_silence_s=4.0
    )
    tracings = [router.tracing, prefill.parts["prefill"].servicer.tracing] + [
        d.parts["decode"].servicer.tracing for d in decodes
    ]
    trace = "5bf92f3577b34da6a3ce929d0e0e4736"
    stopped = []
    try:
        with grpc.insecure_channel(router.address) as channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            sampling = pdserve_pb2.SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
            request = pdserve_pb2.GenerateRequest(
                token_ids=pdserve_pb2.TokenIds(ids=list(range(5, 30))), sampling=sampling
            )
            metadata = (("traceparent", f"00-{trace}-{CLIENT_SPAN}-01"),)
            tokens = 0
            for resp in stub.Generate(request, metadata=metadata, timeout=120):
                if resp.HasField("delta"):
                    tokens += len(resp.delta.token_ids)
                if tokens >= 20 and not stopped:  # the worker streaming it goes away
                    busy = next(d for d in decodes if d.parts["decode"].servicer._streams)
                    busy.stop()
                    stopped.append(busy)
            assert resp.HasField("finish") and tokens == 60
    finally:
        stop_all([], router, prefill, *[d for d in decodes if d not in stopped])
    spans = _spans(collector, [t for t in tracings if t is not None], trace, 1)
    root = next(s for _, s in spans if s.name == "llm_request")
    attrs = {a.key: a.value for a in root.attributes}
    events = [e.name for e in root.events]
    # the resumed leg may prefill on its new decode worker (local prefill, an event too)
    assert events.count("resume") == 1 and set(events) <= {"resume", "local_prefill"}, attrs
    assert {a.key: a.value for a in root.attributes}["pdserve.resumes"].int_value == 1


def test_an_http_request_continues_the_clients_trace(traced):
    collector, router, tracings = traced
    base = f"http://{router.http_address}"
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    trace = "6bf92f3577b34da6a3ce929d0e0e4736"
    body = json.dumps({"model": model, "prompt": "t5 t6 t7", "max_tokens": 4, "temperature": 0})
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=body.encode(),
        headers={"content-type": "application/json", "traceparent": f"00-{trace}-{CLIENT_SPAN}-01"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        assert r.status == 200
    spans = _spans(collector, tracings, trace, 5)
    roots = [s for _, s in spans if s.parent_span_id.hex() == CLIENT_SPAN]
    assert [s.name for s in roots] == ["llm_request"]
    assert {svc for svc, _ in spans} == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}


def test_an_unreachable_endpoint_is_one_line_and_serving_goes_on(model_dir, caplog, monkeypatch):
    import logging
    import socket

    # The exporter's own deadline per batch, retries included (OpenTelemetry's knob, 10 s by
    # default): each failed export gives up sooner, so more of them fail within the test's
    # window, and the test waits less for each flush and shutdown.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "2")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2")

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    caplog.set_level(logging.WARNING, "opentelemetry")
    endpoint = f"http://127.0.0.1:{port}"
    decode = start_decode(model_dir, otlp_traces_endpoint=endpoint)
    prefill = start_prefill(model_dir, otlp_traces_endpoint=endpoint)
    router = start_router(model_dir, decode, prefill, otlp_traces_endpoint=endpoint)
    try:
        for i in range(3):
            responses = _generate(router, list(range(3 + i, 30)))
            assert responses[-1].HasField("finish")
            router.tracing.flush(3000)
    finally:
        stop_all([], router, prefill, decode)
    lines = [r for r in caplog.records if r.name.startswith("opentelemetry")]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert "serving goes on" in lines[0].getMessage()
