"""The Grafana dashboard (deploy/grafana/pdserve.json) as its tests read it: every query in it, and
the metric names a PromQL query names. Used by tests/unit/test_grafana_dashboard.py (against the
router's registry built in-process) and tests/integration/test_metrics_scrape.py (against a
started router's GET /metrics)."""

from __future__ import annotations

import json
import pathlib
import re

DASHBOARD = pathlib.Path(__file__).parents[2] / "deploy" / "grafana" / "pdserve.json"
# the PromQL functions and aggregations a dashboard query may call
FUNCTIONS = {
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
    "label_values", "topk", "clamp_min", "delta", "scalar",
}  # fmt: skip
GROUPING = re.compile(r"\b(by|without|on|ignoring)\s*\([^)]*\)")
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(query: str) -> list[str]:
    """The metric names a PromQL query (or a Grafana label_values()) names: what is left once the
    strings, label matchers, ranges, groupings and numbers are gone, bar the function calls; a
    name PromQL does not know as a function is an error."""
    rest = re.sub(r'"(?:[^"\\]|\\.)*"', "", query)
    rest = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", rest)
    rest = GROUPING.sub(" ", rest)
    if rest.lstrip().startswith("label_values("):  # label_values(metric, label): the metric
        rest = rest.split(",", 1)[0] + ")"
    names = []
    for m in IDENT.finditer(rest):
        word = m.group()
        if rest[m.end() :].lstrip().startswith("("):
            assert word in FUNCTIONS, f"{query}: {word}() is not a function this test knows"
        elif not re.fullmatch(r"\d.*|e", word):
            names.append(word)
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, query) of every query in the dashboard."""
    data = json.loads(DASHBOARD.read_text())
    out = [
        (f"panel {p['title']!r} {t['refId']}", t["expr"])
        for p in data["panels"]
        for t in p.get("targets", [])
    ]
    for var in data["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            out.append((f"variable {var['name']}", query["query"]))
    return out
