"""One OpenTelemetry trace per request across the deployment's processes (optional: the
`otel` extra; without it, or without an endpoint, every call here is a no-op).

Each component (the router, each prefill and decode worker) calls `setup` once at its start with
its service name and the OTLP endpoint (`--otlp-traces-endpoint`, else
`observability.otlp_traces_endpoint`, else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; the protocol from
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, grpc by default), and gets a Tracing of its own: a TracerProvider (resource:
service.name, service.instance.id, pdserve.worker_id) with a batching exporter, so spans leave
the process on the exporter's thread, never on a request's, and `close` flushes it as the
component stops. Nothing is set globally: a router and its workers in one test process keep
their own services apart.

The context travels as W3C `traceparent`/`tracestate` in gRPC metadata: a client's on the
router's Generate call (continued; a malformed one is ignored and a new trace starts, as the
W3C spec says), the router's on every call it makes to a worker for the request (`metadata`).
The router holds the request's span open from arrival to its end; the workers emit theirs after
the fact, from the stamps they take anyway (the Timings fields), with those times, under the
router's span (`emit`); only a prefill worker's prefill span is opened at the call's arrival, so
that the KV frames it sends can carry its context (`traceparent`), and the decode worker's
kv.receive span links to it (`context_of`). So a span costs nothing on the engine's thread, and a worker that dies
mid-request leaves the router's span to say so.
"""

from __future__ import annotations

import logging
import os
import time
import uuid

log = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


def available() -> bool:
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


class Tracing:
    """One process component's spans (the router's, a worker's): its TracerProvider, whose
    resource names the service; `close` flushes and stops its exporter."""

    def __init__(self, provider, scope: str):
        self.provider = provider
        self.tracer = provider.get_tracer(scope)

    def close(self) -> None:
        self.provider.shutdown()

    def flush(self, timeout_ms: int = 5000) -> None:
        self.provider.force_flush(timeout_ms)

    def start(self, name: str, parent=None, start_ns: int | None = None, attributes=None,
              server: bool = False, links=()):  # fmt: skip
        """An open span (end it with `end`). parent: a context from `extract`, or a span.
        links: span contexts (`context_of`) this span follows from in another process."""
        from opentelemetry.trace import Link, SpanKind, set_span_in_context

        if parent is not None and hasattr(parent, "get_span_context"):
            parent = set_span_in_context(parent)
        return self.tracer.start_span(
            name,
            context=parent,
            kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
            start_time=start_ns or None,
            attributes=attributes,
            links=[Link(c) for c in links if c is not None],
        )

    def emit(self, name: str, parent, start_ns: int, end_ns: int, attributes=None, links=(),
             events=()):  # fmt: skip
        """A span that already happened (start_ns..end_ns, unix ns), under `parent`, with its
        `events` ((name, unix ns) pairs; a 0 time leaves that one out); returns it (a parent for
        more), or None when a stamp is missing."""
        if not start_ns or not end_ns:
            return None
        span = self.start(name, parent, start_ns, attributes, links=links)
        for event_name, at_ns in events:
            if at_ns:
                span.add_event(event_name, timestamp=at_ns)
        end(span, max(end_ns, start_ns))
        return span


def setup(
    service: str,
    endpoint: str | None = None,
    sample_ratio: float = 1.0,
    worker_id: str = "",
    exporter=None,
) -> Tracing | None:
    """Tracing for `service` ("pdserve-router", "pdserve-prefill", "pdserve-decode"), exporting to
    `endpoint` (else $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT); `exporter`: a SpanExporter instead
    (tests). None (and one warning line when an endpoint was asked for) when tracing stays off."""
    endpoint = endpoint or os.environ.get(ENDPOINT_ENV) or None
    if endpoint is None and exporter is None:
        return None
    if not available():
        log.warning(
            "OTLP traces endpoint %s is set but OpenTelemetry's SDK is not installed "
            "(pip install 'pdserve[otel]'): tracing is off",
            endpoint,
        )
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if exporter is None:
        exporter = _exporter(endpoint)
        if exporter is None:
            return None
        _quiet_exporter_logs()
    resource = Resource.create(
        {
            "service.name": service,
            "service.instance.id": uuid.uuid4().hex,
            **({"pdserve.worker_id": worker_id} if worker_id else {}),
        }
    )
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio))
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing: %s exports spans to %s", service, endpoint or type(exporter).__name__)
    return Tracing(provider, "pdserve." + service.removeprefix("pdserve-").replace("-", "_"))


class _OneLineEvery(logging.Filter):
    """On the OTLP exporters' loggers: an endpoint that does not answer is one error line every
    REPEAT_S seconds, not two lines a batch (their retry warnings are dropped); spans are
    dropped meanwhile and serving goes on, as the OpenTelemetry spec has exporters do."""

    REPEAT_S = 300.0

    def __init__(self):
        super().__init__()
        self._last = float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return False
        now = time.monotonic()
        if now - self._last < self.REPEAT_S:
            return False
        self._last = now
        record.msg = f"tracing: {record.msg} (spans are dropped until it answers; serving goes on)"
        return True


def _quiet_exporter_logs() -> None:
    for name in (
        "opentelemetry.exporter.otlp.proto.grpc.exporter",
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    ):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OneLineEvery) for f in logger.filters):
            logger.addFilter(_OneLineEvery())


def _exporter(endpoint: str):
    protocol = os.environ.get(PROTOCOL_ENV, "grpc").strip().lower()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            insecure = endpoint.startswith("http://") or "://" not in endpoint
            return OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter(endpoint=endpoint)
    except ImportError as e:
        log.warning("OTLP %s exporter not installed (%s): tracing is off", protocol, e)
        return None
    log.warning("%s=%r is not grpc or http/protobuf: tracing is off", PROTOCOL_ENV, protocol)
    return None


# ---- the context on the wire ---------------------------------------------------------------------
def extract(metadata) -> object | None:
    """The trace context a call's metadata carries (grpc invocation_metadata(), (key, value)
    pairs, or an HTTP header mapping), or None (none, malformed, or OpenTelemetry missing)."""
    if metadata is None or not available():
        return None
    from opentelemetry.trace import get_current_span
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    items = metadata.items() if hasattr(metadata, "items") else metadata
    carrier = {k.lower(): v for k, v in items if k.lower() in TRACE_HEADERS}
    if "traceparent" not in carrier:
        return None
    ctx = TraceContextTextMapPropagator().extract(carrier)
    return ctx if get_current_span(ctx).get_span_context().is_valid else None


def metadata(span) -> tuple[tuple[str, str], ...]:
    """`span`'s context as gRPC metadata pairs for a call made on the request's behalf (() for
    None)."""
    if span is None:
        return ()
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
    return tuple(carrier.items())


def traceparent(span) -> str:
    """`span`'s W3C traceparent, for a channel that has no metadata of its own (the KV frames:
    kvtransfer/wire.py); "" for None."""
    return dict(metadata(span)).get("traceparent", "")


def context_of(traceparent: str):
    """The span context a traceparent names, for a link (None: empty, malformed, or
    OpenTelemetry missing)."""
    if not traceparent:
        return None
    ctx = extract((("traceparent", traceparent),))
    if ctx is None:
        return None
    from opentelemetry.trace import get_current_span

    return get_current_span(ctx).get_span_context()


def end(span, end_ns: int | None = None, attributes=None, error: str | None = None) -> None:
    """Ends `span` (None: nothing), with more attributes and an error status when given."""
    if span is None:
        return
    if attributes:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns or None)


def event(span, name: str, attributes=None) -> None:
    if span is not None:
        span.add_event(name, attributes=attributes or {})
