"""vllm:request_success_total has a series for each of vLLM's finish reasons (stop, length, abort,
error) at 0 from the router's start (router/metrics.py FINISHED_REASONS), as vLLM creates them:
else rate() and increase() miss each reason's first request after a restart, and a panel shows
"No data" for 0. A reason counts up from its zero series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from helpers.metrics import EmptyPool
from pdserve.router.metrics import RouterMetrics, exposition


def _successes(registry) -> dict[tuple[str, str], float]:
    text = exposition(registry).decode()
    return {
        (s.labels["model_name"], s.labels["finished_reason"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "vllm:request_success"
        for s in family.samples
        if s.name == "vllm:request_success_total"
    }


def test_each_finish_reason_is_a_series_at_zero_from_the_start():
    registry = CollectorRegistry(auto_describe=True)
    metrics = RouterMetrics(registry, EmptyPool(), "org/tiny", 2048)
    reasons = ("stop", "length", "abort", "error")
    assert _successes(registry) == {("org/tiny", r): 0.0 for r in reasons}

    metrics.observe_unfinished("error")
    after = _successes(registry)
    assert after[("org/tiny", "error")] == 1.0 and after[("org/tiny", "stop")] == 0.0
    assert len(after) == 4  # counted on its zero series, not a new one
