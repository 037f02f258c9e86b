"""The router's console line (router/console.py) from scripted figures, and the console's
logging set-up (pdserve/logs.py): level precedence, JSON lines, a bad PDSERVE_LOG_LEVEL."""

from __future__ import annotations

import io
import json
import logging
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.deploy.config.schema import ObservabilitySettings
from pdserve.logs import configure_console, console_level
from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.router.console import ConsoleStats

MODEL = "m"


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def router_metrics():
    r = CollectorRegistry()
    m = SimpleNamespace(
        prompt=Counter("vllm:prompt_tokens", "", ["model_name"], registry=r),
        generation=Counter("vllm:generation_tokens", "", ["model_name"], registry=r),
        success=Counter("vllm:request_success", "", ["model_name", "finished_reason"], registry=r),
        inflight=Gauge("pdserve:router_requests_inflight", "", ["model_name"], registry=r),
        queue=Gauge("pdserve:router_decode_queue_waiting", "", ["model_name"], registry=r),
    )
    for c in (m.prompt, m.generation, m.inflight, m.queue):
        c.labels(MODEL)
    return r, m


class Pool:
    def __init__(self):
        self.members = []

    def snapshot(self):
        return list(self.members)


def stats(**kw):
    base = dict(num_total_blocks=100, num_free_blocks=100)
    return worker_pb2.WorkerStats(**{**base, **kw})


def test_idle_says_so_once_then_nothing():
    registry, _ = router_metrics()
    pool = Pool()
    pool.members = [("decode", "decode-0", stats(), False, "serving")]
    console = ConsoleStats(pool, registry, MODEL, 10, clock=Clock())
    assert console.lines() == ["router: idle (no request in flight)"]
    assert console.lines() == []


def test_rates_and_pools_over_the_interval():
    registry, m = router_metrics()
    pool, clock = Pool(), Clock()
    console = ConsoleStats(pool, registry, MODEL, 10, clock=clock)
    prefill = stats(prefix_cache_queries=1000, prefix_cache_hits=100, kv_transfer_bytes=10**6)
    pool.members = [("prefill", "prefill-0", prefill, False, "serving")]
    console.lines()  # the baseline
    clock.t += 10
    m.prompt.labels(MODEL).inc(2000)
    m.generation.labels(MODEL).inc(150)
    m.success.labels(MODEL, "stop").inc(3)
    m.success.labels(MODEL, "abort").inc(1)
    m.inflight.labels(MODEL).set(4)
    pool.members = [
        (
            "prefill",
            "prefill-0",
            stats(
                prefix_cache_queries=3000,
                prefix_cache_hits=1600,
                kv_transfer_bytes=51 * 10**6,
                num_running=1,
                queued_prompt_tokens=812,
                num_free_blocks=60,
            ),
            False,
            "serving",
        ),
        ("decode", "decode-0", stats(num_running=3, num_reserved=1), False, "serving"),
        ("decode", "decode-1", None, True, "serving"),
    ]
    router, decode, prefill_line = console.lines()
    assert router == (
        "router: prompt 200.0 tok/s, generation 15.0 tok/s over 10 s; 4 in flight, 0 waiting "
        "for decode KV; 3 finished, 1 failed or aborted"
    )
    assert prefill_line == (
        "prefill pool: 1 of 1 workers up; running 1, waiting 0; 812 prompt tokens queued; KV "
        "40.0% used; prefix hits 75.0% of 2,000 tokens; KV pushed 5.0 MB/s"
    )
    assert decode.startswith("decode pool: 1 of 2 workers up; running 3, waiting 0, reserved 1")


def test_a_flipping_worker_shows_its_state():
    registry, _ = router_metrics()
    pool = Pool()
    pool.members = [
        ("decode", "decode-0", stats(num_running=1), False, "serving"),
        ("decode", "decode-1", stats(), False, "draining"),
    ]
    lines = ConsoleStats(pool, registry, MODEL, 10, clock=Clock()).lines()
    assert lines[1].startswith("decode pool: 2 of 2 workers up (draining); running 1")


def test_level_precedence_and_a_bad_variable():
    obs = ObservabilitySettings()
    assert console_level(obs, {}) == ("info", None)
    assert console_level(obs, {"PDSERVE_LOG_LEVEL": "DEBUG"}) == ("debug", None)
    level, warning = console_level(obs, {"PDSERVE_LOG_LEVEL": "loud"})
    assert level == "info" and "PDSERVE_LOG_LEVEL='loud'" in warning
    keyed = ObservabilitySettings(log_level="error")
    assert console_level(keyed, {"PDSERVE_LOG_LEVEL": "debug"}) == ("error", None)


def test_json_lines_for_log_shippers():
    stream = io.StringIO()
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        configure_console(ObservabilitySettings(log_format="json"), stream=stream, environ={})
        configure_console(ObservabilitySettings(log_format="json"), stream=stream, environ={})
        logging.getLogger("pdserve.router.console").info("decode pool: %d of %d up", 1, 2)
        lines = stream.getvalue().splitlines()
        assert len(lines) == 1  # the second set-up replaced the first handler
        record = json.loads(lines[0])
        assert record["level"] == "info" and record["logger"] == "pdserve.router.console"
        assert record["message"] == "decode pool: 1 of 2 up" and record["ts"].endswith("Z")
    finally:
        for h in list(root.handlers):
            if h not in before:
                root.removeHandler(h)
        logging.getLogger("pdserve").setLevel(logging.NOTSET)
