"""Stand-ins for what the router's Prometheus collectors read at scrape time (router/metrics.py),
for unit tests that build RouterMetrics without a router. Not a test module: imported as
`from helpers.metrics import EmptyPool`."""

from __future__ import annotations


class EmptyPool:
    """The router's worker pool with no worker registered yet."""

    prefill_tokens_started = 0

    def registered(self, worker_id):
        return None

    def snapshot(self):
        return []

    def members(self):
        return []

    def on_report(self, listener):  # the reconciler listens (router/reconcile.py)
        pass
