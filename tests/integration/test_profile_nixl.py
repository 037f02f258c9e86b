"""`pdserve profile` measures the nixl KV backend (issue 50 item 4): its receiver issues a write
grant per request as a decode worker's Reserve does, and every transfer lands (measure_transfer
raises when one fails or is refused). Skipped where NIXL is not installed."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer.backends.nixl_backend import nixl_available
from pdserve.tuning.profiler import measure_transfer

pytestmark = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed: pip install 'pdserve[nixl]'"
)


def test_profile_measures_nixl_into_granted_blocks():
    info = dict(
        id="tiny", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8,
        kv_bytes_per_token=2 * 2 * 2 * 8 * 4,
    )  # fmt: skip
    out = measure_transfer(info, ["nixl"], dict(transfer_mib=0.25, transfer_requests=2, pings=2))
    nixl = out["nixl"]
    assert nixl["bandwidth_bytes_per_s"] > 0 and nixl["latency_s"] >= 0
    assert nixl["samples"]["bulk_requests"] == 2 and len(nixl["samples"]["ping_s"]) == 2
    assert nixl["locality"] == "same_host"  # what auto's same-host order is ranked by
