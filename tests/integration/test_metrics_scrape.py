"""GET /metrics of a started router, as Prometheus scrapes it (issue 28, must-show c): no
`*_created` series, every metric the Grafana dashboard (deploy/grafana/pdserve.json) queries is
served, and the scrape's own keys (router.metrics_keys_file) open it where the client keys do
not. The router has no worker: refused requests give its counters values. The dashboard's queries
against a registry built without sockets: tests/unit/test_grafana_dashboard.py."""

from __future__ import annotations

import re

import pytest

from helpers.grafana import dashboard_queries, metric_names
from helpers.http import request
from pdserve.planner.policy import PlannerConfig
from pdserve.router.server import Router, RouterConfig

CLIENT_KEY, METRICS_KEY = "sk-client-key-0001", "sk-metrics-key-0001"


@pytest.fixture(scope="module")
def router(tiny_models):
    r = Router(
        RouterConfig(
            model=tiny_models("llama-gqa")[0],
            port=0,
            http_port=0,
            api_keys=(CLIENT_KEY,),
            metrics_keys=(METRICS_KEY,),
            planner=PlannerConfig(1.0, 0.1),
        )
    ).start()
    yield r
    r.stop()


def scrape(router, key: str | None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return request(router.http_address, "GET", "/metrics", headers=headers)


def test_only_a_metrics_key_opens_metrics(router):
    assert scrape(router, None)[0] == 401
    status, _, body = scrape(router, CLIENT_KEY)  # a client key is not a scrape credential
    assert status == 401 and b"router.metrics_keys_file" in body
    assert scrape(router, METRICS_KEY)[0] == 200
    # and a metrics key is no client key
    status, _, _ = request(router.http_address, "GET", "/v1/models", headers=_bearer(METRICS_KEY))
    assert status == 401
    assert request(router.http_address, "GET", "/v1/models", headers=_bearer(CLIENT_KEY))[0] == 200


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_no_created_series_and_every_dashboard_metric_served(router):
    body = {"prompt": "t5 t6", "max_tokens": 2, "model": ""}
    for _ in range(2):  # no worker: 503, which counts in the error counters
        request(router.http_address, "POST", "/v1/completions", body, headers=_bearer(CLIENT_KEY))
    status, _, text = scrape(router, METRICS_KEY)
    text = text.decode()
    assert status == 200 and "pdserve:http_errors_total{" in text
    assert "_created" not in text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    served = set()
    for name, kind in types.items():
        suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
        served.update(name + s for s in suffixes)
    assert "pdserve:planner_decisions_total" in served and "pdserve:worker_up" in served
    for where, query in dashboard_queries():
        missing = [n for n in metric_names(query) if n not in served]
        assert not missing, f"{where}: {missing} not on the router's /metrics"
