"""Admin.Flip's refusals are counted in pdserve:role_flips (router/flips.py): a role that is not
one of the pool's roles is counted under the fixed label "invalid", so a caller cannot mint a
metric series per string it sends."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import CollectorRegistry

from helpers.metrics import EmptyPool
from pdserve.router.flips import FlipRefused, Flips
from pdserve.router.pool import ROLES


def test_roles_that_are_not_roles_share_one_label():
    registry = CollectorRegistry()
    flips = Flips(EmptyPool(), None, registry=registry, model_name="m")
    for i in range(50):
        with pytest.raises(FlipRefused) as e:
            flips.flip("w1", f"role-{i:04d}-padding-padding")
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(FlipRefused) as e:  # a real role: refused for the missing worker
        flips.flip("w1", ROLES[0])
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    counts = {  # every series of the counter: all refused
        s.labels["to_role"]: s.value
        for m in registry.collect()
        if m.name == "pdserve:role_flips"
        for s in m.samples
        if s.name.endswith("_total")
    }
    assert counts == {"invalid": 50.0, ROLES[0]: 1.0}
