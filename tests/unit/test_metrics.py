"""The router's metrics without a router: the stage durations of a request's timings
(protos/timings.py), for a colocated request and for stages it never reached, and the 1-2-5
histogram buckets (router/metrics.py). Through a real router:
tests/integration/test_metrics_cluster.py."""

from __future__ import annotations

import pytest

from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.protos.timings import STAGES, stage_durations
from pdserve.router.metrics import build_1_2_5_buckets


def test_stage_durations_of_a_colocated_request_and_of_stages_not_reached():
    t = pdserve_pb2.Timings(
        queued_unix_ns=1_000, reserved_unix_ns=3_000, first_token_unix_ns=9_000,
        last_token_unix_ns=12_000,
    )  # fmt: skip
    d = stage_durations(t)
    assert d["router_queue_s"] == pytest.approx(2e-6)
    assert d["decode_s"] == pytest.approx(3e-6)
    assert d["ttft_s"] == pytest.approx(8e-6) and d["e2e_s"] == pytest.approx(11e-6)
    assert [d[f"{s}_s"] for s in STAGES[1:5]] == [None] * 4
    d = stage_durations(pdserve_pb2.Timings(queued_unix_ns=5))
    assert all(v is None for v in d.values())


def test_one_two_five_buckets():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(256)[-1] == 200
