"""deploy/grafana/pdserve.json against what the router serves: every query of the dashboard (its
panels' and its variables') parses into functions PromQL has and metric names that the router's
registry serves, and the panels the operators asked for are there (issue 28). The registry is
built in this process as Router.start builds it (RouterMetrics, the router's gauges, role flips,
the planner), with no socket; the same check against a started router's GET /metrics, and that it
has no `*_created` series: tests/integration/test_metrics_scrape.py."""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from helpers.grafana import DASHBOARD, dashboard_queries, metric_names
from helpers.metrics import EmptyPool
from pdserve.planner.live import PlannerLoop
from pdserve.planner.policy import PlannerConfig
from pdserve.router.flips import Flips
from pdserve.router.metrics import RouterMetrics, exposition, served_names, track_batches
from pdserve.router.openai.batches_api import Batches
from pdserve.router.openai.files_api import FileStore
from pdserve.router.planner_actuator import RouterActuator


def router_registry(with_metrics: bool = False):
    """The router's registry as Router.start fills it (router/server.py), without a socket (and
    its RouterMetrics, with_metrics)."""
    registry, pool = CollectorRegistry(auto_describe=True), EmptyPool()
    metrics = RouterMetrics(registry, pool, "m", 2048)
    metrics.track_router(lambda: 0, lambda: 0)
    flips = Flips(pool, None, registry=registry, model_name="m")
    actuator = RouterActuator(pool, flips, None, metrics.recent)
    PlannerLoop(PlannerConfig(1.0, 0.1), actuator, registry, "m")
    # the HTTP front's Batch API (router/openai/app.py build_app registers it as the front starts)
    track_batches(registry, "m", Batches(FileStore(1 << 20), 1))
    return (registry, metrics) if with_metrics else registry


def test_every_query_names_metrics_the_router_serves():
    served = served_names(router_registry())
    queries = dashboard_queries()
    assert len(queries) >= 12
    for where, query in queries:
        names = metric_names(query)
        assert names, f"{where}: {query} names no metric"
        missing = [n for n in names if n not in served]
        assert not missing, f"{where}: {missing} not served by the router's /metrics"


def test_the_dashboard_has_the_panels_operators_need():
    titles = {p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]}
    for title in (
        "Requests", "TTFT", "TPOT", "Queues", "KV cache usage", "Worker roles", "Role flips",
        "Local prefills", "Planner decisions", "Speculative decoding", "Host KV tier",
        "Disk KV tier", "Prompt cache hits", "Batch API",
    ):  # fmt: skip
        assert title in titles


def test_every_kv_tier_series_is_on_the_dashboard():
    """Each worker's host and disk tier series the router exports is queried by some panel
    (issue 49), and the hits by source are shown with every source, "disk" included."""
    served = served_names(router_registry())
    tiers = {n for n in served if n.startswith(("pdserve:kv_host_tier_", "pdserve:kv_disk_tier_"))}
    assert {
        "pdserve:kv_disk_tier_bytes",
        "pdserve:kv_disk_tier_capacity_bytes",
        "pdserve:kv_disk_tier_dropped_blocks_total",
        "pdserve:kv_disk_tier_refused_blocks_total",
        "pdserve:kv_disk_tier_write_errors_total",
        "pdserve:kv_host_tier_refused_blocks_total",
    } <= tiers
    queries = dashboard_queries()
    queried = {n for _, query in queries for n in metric_names(query)}
    assert sorted(tiers - queried) == []
    by_source = [
        query for _, query in queries if "pdserve:prefix_cache_hit_tokens_by_source" in query
    ]
    assert by_source
    for query in by_source:  # grouped by source, none filtered out
        assert re.search(r"\bby\s*\([^)]*\bsource\b", query) and "source=" not in query
        assert "source!" not in query


@pytest.mark.parametrize(
    ("query", "names"),
    [
        (
            'histogram_quantile(0.9, sum by (le) (rate(vllm:x_bucket{a=~"$m"}[5m])))',
            ["vllm:x_bucket"],
        ),
        ('sum by (role) (pdserve:w{state="serving", m="a}b"})', ["pdserve:w"]),
        ("label_values(pdserve:worker_up, model_name)", ["pdserve:worker_up"]),
        ("up", ["up"]),  # not served: the test above would fail it
    ],
)
def test_the_query_parser_finds_the_metric_names(query, names):
    assert metric_names(query) == names


def test_the_parser_refuses_an_unknown_function():
    with pytest.raises(AssertionError, match=r"absent_over_time\(\)"):
        metric_names("absent_over_time(pdserve:worker_up[5m])")


def test_no_created_series_in_the_exposition(monkeypatch):
    import prometheus_client.metrics

    registry, metrics = router_registry(with_metrics=True)
    metrics.success.labels("m", "stop").inc()
    metrics.ttft.observe(0.1)
    metrics.local_prefills.inc()
    text = exposition(registry).decode()
    assert 'vllm:request_success_total{finished_reason="stop",model_name="m"} 1.0' in text
    assert "vllm:time_to_first_token_seconds_count" in text and "_created" not in text
    # prometheus_client's switch turned back on (another library in the process): still none
    monkeypatch.setattr(prometheus_client.metrics, "_use_created", True)
    assert "_created" in generate_latest(registry).decode()
    assert "_created" not in exposition(registry).decode()
