"""protos/tracing.py without a network: off unless an endpoint or exporter is given, the W3C
context in and out of gRPC metadata (a malformed traceparent ignored), spans emitted after the
fact with the given times under the given parent, and each component's own service name."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("opentelemetry.sdk", reason="tracing needs the otel extra")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

from pdserve.protos import tracing  # noqa: E402

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def test_off_without_an_endpoint(monkeypatch):
    monkeypatch.delenv(tracing.ENDPOINT_ENV, raising=False)
    assert tracing.setup("pdserve-router") is None
    assert tracing.metadata(None) == ()
    tracing.end(None)  # nothing to end: no error
    tracing.event(None, "resume")


def test_a_bad_protocol_is_one_warning_and_tracing_off(monkeypatch, caplog):
    monkeypatch.setenv(tracing.PROTOCOL_ENV, "carrier-pigeon")
    caplog.set_level(logging.WARNING, "pdserve.protos.tracing")
    assert tracing.setup("pdserve-router", "http://127.0.0.1:1") is None
    assert len(caplog.records) == 1 and "carrier-pigeon" in caplog.records[0].getMessage()


def test_the_context_crosses_metadata_and_bad_ones_are_ignored():
    good = (("traceparent", f"00-{TRACE}-{PARENT}-01"), ("other", "x"))
    ctx = tracing.extract(good)
    assert ctx is not None
    for bad in ((("traceparent", "00-zz-nonsense-01"),), (("x", "y"),), None, ()):
        assert tracing.extract(bad) is None
    exporter = InMemorySpanExporter()
    t = tracing.setup("pdserve-router", exporter=exporter)
    try:
        span = t.start("llm_request", ctx, 1_000, server=True)
        md = dict(tracing.metadata(span))
        assert md["traceparent"].split("-")[1] == TRACE  # the workers continue this trace
        assert tracing.extract(md) is not None
        tracing.end(span, 5_000, attributes={"a": 1, "skipped": None}, error="boom")
        t.flush()
    finally:
        t.close()
    (done,) = exporter.get_finished_spans()
    assert f"{done.context.trace_id:032x}" == TRACE and f"{done.parent.span_id:016x}" == PARENT
    assert done.start_time == 1_000 and done.end_time == 5_000
    assert done.attributes["a"] == 1 and "skipped" not in done.attributes
    assert done.status.description == "boom"
    assert done.resource.attributes["service.name"] == "pdserve-router"


def test_spans_after_the_fact_nest_under_their_parent():
    exporter = InMemorySpanExporter()
    t = tracing.setup("pdserve-prefill", worker_id="prefill-0", exporter=exporter)
    try:
        parent = tracing.extract((("traceparent", f"00-{TRACE}-{PARENT}-01"),))
        span = t.emit("prefill", parent, 100, 900, {"pdserve.request_id": "r1"})
        t.emit("prefill.compute", span, 200, 800)
        assert t.emit("kv.push", span, 0, 900) is None  # a stamp never taken: no span
        t.flush()
    finally:
        t.close()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"prefill", "prefill.compute"}
    assert spans["prefill.compute"].parent.span_id == spans["prefill"].context.span_id
    assert (spans["prefill.compute"].start_time, spans["prefill.compute"].end_time) == (200, 800)
    assert spans["prefill"].resource.attributes["pdserve.worker_id"] == "prefill-0"


def test_a_frames_traceparent_becomes_a_link_and_a_bad_one_is_dropped():
    exporter = InMemorySpanExporter()
    t = tracing.setup("pdserve-decode", exporter=exporter)
    try:
        sender = t.start("prefill", tracing.extract((("traceparent", f"00-{TRACE}-{PARENT}-01"),)))
        carried = tracing.traceparent(sender)
        assert carried.split("-")[1] == TRACE and tracing.traceparent(None) == ""
        for bad in ("", "00-zz-nonsense-01", "x" * 55):
            assert tracing.context_of(bad) is None
        t.emit("kv.receive", None, 1_000, 2_000, links=(tracing.context_of(carried), None))
        tracing.end(sender)
        t.flush()
    finally:
        t.close()
    receive = next(s for s in exporter.get_finished_spans() if s.name == "kv.receive")
    [link] = receive.links
    assert link.context.span_id == sender.get_span_context().span_id
    assert f"{link.context.trace_id:032x}" == TRACE
