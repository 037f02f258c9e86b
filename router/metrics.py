"""The cluster's Prometheus metrics, all on the router's registry (Router.metrics_registry), so one
scrape of the router's GET /metrics gives every figure of every worker.

The Router creates one RouterMetrics as it starts, and it lives as long as the router. Per-request
figures are observed in the router as each request's tokens arrive and as it ends (its Finish:
usage and timings). Per-worker figures are read at scrape time by WorkerCollector, from the
WorkerStats that the router's WorkerPool already keeps: a scrape never makes an RPC, so it cannot
wait on a slow worker. Worker counters restart at 0 with the worker process, which Prometheus's
rate() and increase() allow. Names, types and bucket layouts follow vLLM's
(vllm/v1/metrics/loggers.py), with model_name on every series. As vLLM does, no `*_created`
series: the module turns prometheus_client's off as it is imported, and `exposition`, which
renders GET /metrics, leaves out any a collector still yields. The per-worker families are
router/worker_metrics.py's. deploy/grafana/pdserve.json is a
dashboard over these names (tests/unit/test_grafana_dashboard.py keeps the two in step).
"""

from __future__ import annotations

import logging

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from pdserve.protos.convert import unix_ns
from pdserve.protos.timings import STAGES, stage_durations
from pdserve.router.recent import RecentRequests
from pdserve.router.worker_metrics import (  # noqa: F401 (re-exported: the metrics' one module)
    WORKER_COUNTERS,
    WORKER_STATES,
    WorkerCollector,
)

log = logging.getLogger(__name__)
disable_created_metrics()  # process-wide: one `_created` per series doubles a scrape's lines
_NS = 1e-9
_FINE = [0.001, 0.0025, 0.005]  # below vLLM's buckets
# vLLM's layouts, plus (marked +) a few finer buckets where a CPU cluster's TTFTs and decode steps
# fall: histogram_quantile interpolates linearly inside a bucket, so a wide bucket moves the
# median it reports (docs/experiments/design-measurements.md). Every vLLM bound stays, so
# dashboards that pick `le` values still match.
TTFT_BUCKETS = [  # + 0.15, 0.2, 0.3, 0.4
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
ITL_BUCKETS = _FINE + [  # + _FINE, 0.015, 0.02
    0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
REQUEST_LATENCY_BUCKETS = _FINE + [0.01, 0.025, 0.05, 0.1] + [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
STAGE_BUCKETS = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 480.0, 1920.0,
]  # fmt: skip
BYTES_BUCKETS = [float(1 << k) for k in range(10, 35, 2)]  # 1 KiB .. 16 GiB, x4
# vllm:request_time_per_output_token_seconds's (vLLM's layout, with ITL_BUCKETS' finer ones)
TPOT_BUCKETS = ITL_BUCKETS
N_BUCKETS = [1, 2, 5, 10, 20]  # vllm:request_params_n's, vLLM's
# vllm:request_success_total's finished_reason values, vLLM's FinishReason (v1/engine)
FINISHED_REASONS = ("stop", "length", "abort", "error")
RATIO_BUCKETS = [0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]

# (attribute, name, documentation, buckets: None for the token-count ones) of the per-request
# histograms labelled by model_name alone, in the order a scrape lists them
_REQUEST_HISTOGRAMS = (
    (
        "ttft",
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        TTFT_BUCKETS,
    ),
    (
        "itl",
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        ITL_BUCKETS,
    ),
    (
        "e2e",
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        REQUEST_LATENCY_BUCKETS,
    ),
    (
        "queue",
        "vllm:request_queue_time_seconds",
        "Histogram of time spent waiting (router and prefill queues) for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    (
        "prefill",
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase (compute start to first token, KV "
        "hand-off included) for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    (
        "decode",
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    (
        "inference",
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase (prefill and decode) for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    (
        "tpot",
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        TPOT_BUCKETS,
    ),
    ("prompt_hist", "vllm:request_prompt_tokens", "Number of prefill tokens processed.", None),
    (
        "generation_hist",
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        None,
    ),
    (
        "max_generation_hist",
        "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        None,
    ),
    (
        "params_max_tokens",
        "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.",
        None,
    ),
    ("params_n", "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS),
)
# the same for the KV hand-off's, registered after the stage histogram
_TRANSFER_HISTOGRAMS = (
    (
        "transfer_s",
        "pdserve:request_kv_transfer_seconds",
        "KV hand-off per request: the first layer handed to the transport -> the last "
        "KV frame and the commit landed on the decode worker.",
        STAGE_BUCKETS,
    ),
    (
        "transfer_bytes",
        "pdserve:request_kv_transfer_bytes",
        "KV bytes the prefill worker pushed into the decode worker's reservation, per "
        "request (prefix-cache hits on the decode worker are not sent).",
        BYTES_BUCKETS,
    ),
    (
        "exposed_s",
        "pdserve:request_kv_transfer_exposed_seconds",
        "KV transfer not hidden behind the prefill compute: prefill end -> the last KV "
        "frame landed.",
        STAGE_BUCKETS,
    ),
    (
        "exposed_ratio",
        "pdserve:request_kv_transfer_exposed_ratio",
        "The exposed share of each request's KV transfer time (0: all hidden behind the "
        "compute, 1: all after it).",
        RATIO_BUCKETS,
    ),
    (
        "reservation_wait",
        "pdserve:request_reservation_wait_seconds",
        "Reserve on a decode worker until it succeeded, waits in the router's decode "
        "queue (every decode worker's KV full) included.",
        STAGE_BUCKETS,
    ),
)


class _NoCreated(Collector):
    """`registry`'s families without their `*_created` samples."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


def exposition(registry: CollectorRegistry) -> bytes:
    """GET /metrics's body: Prometheus's text format of `registry`, no `*_created` series."""
    return generate_latest(_NoCreated(registry))


def served_names(registry: CollectorRegistry) -> set[str]:
    """Every series name a scrape of `registry` can show, each family's samples included before
    they have a value: a counter's NAME_total, a histogram's _bucket, _sum and _count, a gauge's
    NAME (what a dashboard's query may name)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    names = set()
    for family in registry.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return [float(v) for v in out]
            out.append(m * scale)
        scale *= 10


def _longest_output(finish, req) -> int:
    """The most tokens one of the request's sequences generated: `finish` counts them all
    (router/service.py request_finish), req.finishes those of the sequences that ended first."""
    earlier = [f.usage.completion_tokens for f in getattr(req, "finishes", ())]
    return max([finish.usage.completion_tokens - sum(earlier), *earlier])


def _seconds(start_ns: int, end_ns: int) -> float | None:
    if not start_ns or not end_ns:
        return None
    return max(0, end_ns - start_ns) * _NS


class RouterMetrics:
    """The per-request figures, observed by the router's PDServe service; and the collector of
    the workers' figures, registered on the same registry.

    What it measures for vLLM's phases of a disaggregated request:
      vllm:time_to_first_token_seconds   arrival at the router -> the router got the first token
      vllm:inter_token_latency_seconds   gaps between a sequence's token events at the router,
                                         split evenly over the tokens an event carries
      vllm:e2e_request_latency_seconds   arrival -> the router built the Finish
      vllm:request_queue_time_seconds    arrival -> the prefill compute started (router and
                                         prefill worker queues; colocated: until the Reserve)
      vllm:request_prefill_time_seconds  prefill compute start -> first token (hand-off included)
      vllm:request_decode_time_seconds   first token -> last token (decode worker)
      vllm:request_inference_time_seconds  prefill compute start -> last token
    vllm:request_success_total counts every admitted request once, by its Finish's reason, or as
    abort or error when it ended without one (`observe_unfinished`); vLLM's reasons
    (FINISHED_REASONS) are series from the start, at 0."""

    def __init__(
        self,
        registry: CollectorRegistry,
        pool,
        model_name: str,
        max_model_len: int,
        colocated: bool = False,
    ):
        self.model_name = model_name
        self.recent = RecentRequests()  # the planner's window (planner/live.py)
        self._registry = registry
        token_buckets = build_1_2_5_buckets(max_model_len)
        for attr, name, doc, buckets in _REQUEST_HISTOGRAMS:
            metric = self._histogram(name, doc, buckets or token_buckets)
            setattr(self, attr, metric.labels(model_name))
        self._add_counters()
        # each of vLLM's finish reasons is a series from the start, at 0 (as vLLM creates them):
        # else rate() and increase() miss a reason's first request after a restart, and an alert
        # on one (finished_reason="error") never sees the first
        for reason in FINISHED_REASONS:
            self.success.labels(model_name, reason)
        self.stage = self._histogram(
            "pdserve:request_stage_seconds",
            "Where each request's time went, by stage (protos/timings.py).",
            STAGE_BUCKETS,
            ["stage"],
        )
        self.stages = {s: self.stage.labels(model_name, s) for s in STAGES}
        for attr, name, doc, buckets in _TRANSFER_HISTOGRAMS:
            setattr(self, attr, self._histogram(name, doc, buckets).labels(model_name))
        self.admission_wait = self._histogram(
            "pdserve:router_admission_wait_seconds",
            "Time each admitted Generate call waited in the router's admission queue (0 when a "
            "slot was free: router/admission.py).",
            REQUEST_LATENCY_BUCKETS,
        ).labels(model_name)
        self.admission_shed = Counter(
            "pdserve:router_admission_shed",
            "Queued calls that gave their place in a full admission queue to another tenant's "
            "arrival, because their tenant had the most calls waiting (router/admission.py).",
            ["model_name"],
            registry=registry,
        ).labels(model_name)
        self.workers = WorkerCollector(pool, model_name, colocated)
        registry.register(self.workers)
        registry.register(DeathCollector(pool, model_name))

    def _histogram(self, name: str, doc: str, buckets, extra=()) -> Histogram:
        labels = ["model_name", *extra]
        return Histogram(name, doc, labels, buckets=buckets, registry=self._registry)

    def _add_counters(self) -> None:
        """The token and request counters (registered after the request histograms: a scrape
        lists the families in the order they were registered)."""
        labels, r, model = ["model_name"], self._registry, self.model_name
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        ).labels(model)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        ).labels(model)
        self.success = Counter(
            "vllm:request_success",
            "Count of processed requests, by finish reason.",
            labels + ["finished_reason"],
            registry=r,
        )
        self.errors = Counter(
            "pdserve:request_errors",
            "Generate calls that ended with an error status, by gRPC status code (refusals "
            "before admission included; an HTTP request the front refused itself is not one).",
            labels + ["code"],
            registry=r,
        )
        self.http_errors = Counter(
            "pdserve:http_errors",
            "Error responses of the OpenAI HTTP front, by HTTP status (its own refusals and the "
            "failed Generate calls it relays).",
            labels + ["status"],
            registry=r,
        )
        self.local_prefills = Counter(
            "pdserve:local_prefills",
            "Disaggregated requests whose prompt their decode worker ran itself, with no prefill "
            "leg and no KV transfer (planner/local_prefill.py).",
            labels,
            registry=r,
        ).labels(model)
        self.joined_events = Counter(
            "pdserve:router_joined_token_events",
            "Token events the router sent joined to the one before them, because it had not "
            "read them yet when the next came (router/decode_streams.py): growing while the "
            "router, not its workers, sets the pace of the streams.",
            labels,
            registry=r,
        ).labels(model)
        self.stale_cache_hints = Counter(
            "pdserve:stale_cache_hints",
            "Requests sent to a decode worker to prefill there for the cached prefix it was "
            "believed to hold, which it had evicted: refused before any work and sent to the "
            "prefill pool instead (docs/architecture.md section 11).",
            labels,
            registry=r,
        ).labels(model)
        self.cache_hits = Counter(
            "pdserve:prompt_cache_hit_tokens",
            "Prompt tokens served from a prefix cache, by where (Usage.cache_hits): "
            "prefill_worker (not computed), decode_worker (a conversation's earlier turns the "
            "decode worker kept: not computed when it ran the prompt itself, else not "
            "transferred), peer (of prefill_worker, those the prefill worker pulled from the "
            "decode worker: peer fetch).",
            labels + ["source"],
            registry=r,
        )
        self.reuse_paths = Counter(
            "pdserve:reuse_paths",
            "Turns through the prefill pool whose decode worker held a cached prefix, by the "
            "path chosen by estimated cost (router/peer_fetch.py): peer_fetch (the prefill "
            "worker pulled it), prefill_cache (a fetch was allowed, and the prefill worker "
            "held it all already) or recompute; a turn run on its decode worker counts in "
            "pdserve:local_prefills.",
            labels + ["path"],
            registry=r,
        )
        self.peer_fetch_seconds = self._histogram(
            "pdserve:peer_fetch_duration_seconds",
            "Time a prefill worker spent pulling a turn's cached prefix from its decode worker "
            "(PrefillResponse.peer_fetch_seconds).",
            (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        ).labels(model)

    def on_reuse_path(self, path: str, reply) -> None:
        """A turn's reuse path (router/legs.py `on_reuse_path`): its count, and the fetch's
        seconds when the prefill worker pulled."""
        self.reuse_paths.labels(self.model_name, path).inc()
        if reply is not None and reply.peer_fetch_seconds > 0:
            self.peer_fetch_seconds.observe(reply.peer_fetch_seconds)

    def track_router(
        self, inflight, decode_queue_waiting, paused=lambda: 0.0, tenants_waiting=lambda: 0.0
    ) -> None:
        """Router gauges read at scrape time: callables giving the Generate calls in flight, the
        requests waiting in the router's decode queue, 1 while the router's admission is paused
        (router/pause.py), and the tenants with calls in its admission queue."""
        for name, doc, read in (
            ("pdserve:router_requests_inflight", "Generate calls the router is serving.", inflight),
            (
                "pdserve:router_decode_queue_waiting",
                "Requests waiting in the router for decode KV blocks (every decode worker full).",
                decode_queue_waiting,
            ),
            (
                "pdserve:router_paused",
                "1 while the router admits no request (/pause, or a weight update under way).",
                paused,
            ),
            (
                "pdserve:router_admission_tenants_waiting",
                "Tenants (API keys; without keys, every client is one) with calls waiting in the "
                "router's admission queue, which shares its slots between them.",
                tenants_waiting,
            ),
        ):
            gauge = Gauge(name, doc, ["model_name"], registry=self._registry)
            gauge.labels(self.model_name).set_function(read)

    # ---- per request ----------------------------------------------------------------------------
    def on_tokens(self, req, index: int, num_tokens: int) -> None:
        """A token event of sequence `index` reached the router: its gap from the sequence's
        previous event, split evenly over the event's tokens (the first event's extra tokens get
        gaps of 0, as tuning/metrics.attribute_itl counts them)."""
        now = unix_ns()
        last = req.token_clock.get(index)
        req.token_clock[index] = now
        if last is None:
            gaps = [0.0] * (num_tokens - 1)
        else:
            gaps = [max(0, now - last) * _NS / num_tokens] * num_tokens
        for gap in gaps:
            self.itl.observe(gap)
        if last is not None:
            self.recent.gap(gaps[0])

    def observe_unfinished(self, reason: str) -> None:
        """An admitted request ended without a Finish: "abort" (the client cancelled or left) or
        "error" (a worker failed it); vLLM counts its aborts under the same counter."""
        self.success.labels(self.model_name, reason).inc()

    def observe_error(self, code) -> None:
        """A Generate call ended with `code` (a grpc.StatusCode other than OK)."""
        self.errors.labels(self.model_name, code.name).inc()

    def observe_http_error(self, status: int) -> None:
        """The HTTP front answered with an error status (4xx/5xx)."""
        self.http_errors.labels(self.model_name, str(status)).inc()

    def observe_finish(self, finish, req, first_leg, end_ns: int) -> None:
        """One request ended with `finish` (the router's, timings and usage filled in)."""
        try:
            self._observe_finish(finish, req, first_leg, end_ns)
        except Exception:  # a metrics bug must never fail a request
            log.exception("metrics of request %s not recorded", req.request_id)

    def _observe_finish(self, finish, req, first_leg, end_ns: int) -> None:
        t, usage = finish.timings, finish.usage
        self.success.labels(self.model_name, finish.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.prompt_hist.observe(usage.prompt_tokens)
        self.generation_hist.observe(usage.completion_tokens)
        longest = _longest_output(finish, req)
        self._observe_params(req, longest)
        for source in ("prefill_worker", "decode_worker", "peer"):
            self.cache_hits.labels(self.model_name, source).inc(getattr(usage.cache_hits, source))
        stages = stage_durations(t)
        for name in STAGES:
            value = stages[f"{name}_s"]
            if value is not None:
                self.stages[name].observe(value)
        self.e2e.observe(_seconds(t.queued_unix_ns, end_ns) or 0.0)
        ttft = _seconds(t.queued_unix_ns, req.first_token_ns)
        if ttft is not None:
            self.ttft.observe(ttft)
        self.recent.add(ttft, stages["decode_s"], usage, t)
        started = t.prefill_start_unix_ns
        queue = _seconds(t.queued_unix_ns, started or t.reserved_unix_ns)
        # vLLM's per-request mean time per output token: decode time over the tokens after
        # the first (the sequence that ended the request), 0 for a one-token answer
        decode_s = stages["decode_s"]
        self.tpot.observe(decode_s / (longest - 1) if longest > 1 and decode_s else 0.0)
        for hist, value in (
            (self.queue, queue),
            (self.prefill, _seconds(started, t.first_token_unix_ns)),
            (self.decode, decode_s),
            (self.inference, _seconds(started, t.last_token_unix_ns)),
            (self.reservation_wait, _seconds(first_leg.reserve_start_ns, first_leg.reserved_ns)),
        ):
            if value is not None:
                hist.observe(value)
        if not t.prefill_end_unix_ns:  # colocated, or the prefill's reply never came
            return
        self.transfer_bytes.observe(usage.kv_transfer_bytes)
        exposed = stages["kv_transfer_exposed_s"]
        if exposed is not None:
            self.exposed_s.observe(exposed)
        total = _seconds(t.transfer_start_unix_ns, t.transfer_end_unix_ns)
        if total is not None:
            self.transfer_s.observe(total)
            if exposed is not None and total > 0:
                self.exposed_ratio.observe(min(1.0, exposed / total))

    def _observe_params(self, req, longest: int) -> None:
        """vLLM's per-request parameter histograms: n, max_tokens (as the request ran, after the
        router fitted it to the context) and the most tokens one of its sequences generated."""
        sampling = getattr(req, "sampling", None)
        if sampling is None:
            return
        self.params_n.observe(sampling.n if sampling.HasField("n") else 1)
        if sampling.HasField("max_tokens"):
            self.params_max_tokens.observe(sampling.max_tokens)
        self.max_generation_hist.observe(longest)


class DeathCollector(Collector):
    """pdserve:worker_deaths_total{cause}: the workers the pool declared dead since the router
    started, read at scrape time from WorkerPool.deaths (router/pool.py): `silent` (no Stats
    answer and no heartbeat for router.worker_silence_s) or `stalled` (its engine stuck in one
    turn past its stall bound). A worker merely down (skipped for new work) is not counted: that
    is pdserve:worker_up 0."""

    def __init__(self, pool, model_name: str):
        self.pool, self.model_name = pool, model_name

    def collect(self):
        family = CounterMetricFamily(
            "pdserve:worker_deaths",
            "Workers declared dead (their calls resumed elsewhere), by cause: silent or stalled.",
            labels=["model_name", "cause"],
        )
        for cause, count in sorted(getattr(self.pool, "deaths", {}).items()):
            family.add_metric([self.model_name, cause], count)
        yield family


class BatchCollector(Collector):
    """pdserve:batch_requests_total{outcome}: the Batch API's lines with a result since the front
    started (router/openai/batches_api.py), `completed` (answered 200: the output file) or `failed`
    (any other answer, or not run: the error file), read at scrape time."""

    def __init__(self, batches, model_name: str):
        self.batches, self.model_name = batches, model_name

    def collect(self):
        family = CounterMetricFamily(
            "pdserve:batch_requests",
            "Batch API requests with a result, by outcome: completed or failed.",
            labels=["model_name", "outcome"],
        )
        for outcome, count in sorted(self.batches.lines_run.items()):
            family.add_metric([self.model_name, outcome], count)
        yield family


def track_batches(registry, model_name: str, batches) -> None:
    """The HTTP front's Batch API and file store, read at scrape time: batches in progress, their
    lines running now, the lines done (BatchCollector), and the files' bytes against their
    bound."""
    registry.register(BatchCollector(batches, model_name))
    files = batches.files
    for name, doc, read in (
        ("pdserve:batches_in_progress", "Batches validating, running or finalizing.", batches.active),
        ("pdserve:batch_requests_running", "Batch API requests running now.",
         lambda: batches.running_lines),
        ("pdserve:files_store_bytes", "Bytes of the Files API's files on the router's disk.",
         lambda: files.bytes),
        ("pdserve:files_store_max_bytes", "The files' bound (router.files_store_mb).",
         lambda: files.max_bytes),
    ):  # fmt: skip
        Gauge(name, doc, ["model_name"], registry=registry).labels(model_name).set_function(read)


def track_responses(registry, model_name: str, store) -> None:
    """The HTTP front's stored Responses (router/openai/responses/store.py), read at scrape time:
    how many are stored, their bytes against the store's bound, and the background ones running."""
    for name, doc, read in (
        (
            "pdserve:responses_stored",
            "Responses kept for previous_response_id and GET.",
            store.__len__,
        ),
        ("pdserve:responses_store_bytes", "Bytes of the stored responses.", lambda: store.bytes),
        (
            "pdserve:responses_store_max_bytes",
            "The stored responses' bound (router.responses_store_mb).",
            lambda: store.max_bytes,
        ),
        (
            "pdserve:responses_background_running",
            "Background responses in progress.",
            lambda: len(store.running),
        ),
    ):
        Gauge(name, doc, ["model_name"], registry=registry).labels(model_name).set_function(read)
