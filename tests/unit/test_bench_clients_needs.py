"""helpers/bench_clients.py's `needs`: a benchmark client's test skips where the client is not
installed, except in the clients' lane (scripts/test_clients.sh sets PDSERVE_REQUIRE_CLIENTS=1),
where it fails instead, and runs as written where the client is installed."""

from __future__ import annotations

import pytest

from helpers.bench_clients import REQUIRE_ENV, needs

MISSING = "pdserve_no_such_client_module"
PRESENT = "json"


def _test(cluster, tmp_path):
    return ("ran", cluster, tmp_path)


def test_a_missing_client_skips_outside_the_clients_lane(monkeypatch):
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    mark = needs(MISSING, "client==1").mark
    assert mark.name == "skipif" and mark.args == (True,)
    assert "client==1 is not installed" in mark.kwargs["reason"]
    assert needs(PRESENT, "json").mark.args == (False,)


def test_a_missing_client_fails_in_the_clients_lane(monkeypatch):
    monkeypatch.setenv(REQUIRE_ENV, "1")
    marked = pytest.mark.parametrize("cluster", [1])(_test)
    decorated = needs(MISSING, "client==1")(marked)
    assert decorated is not marked
    # pytest still sees the test's fixtures and its marks through the wrapper
    assert decorated.__wrapped__ is marked
    assert [m.name for m in decorated.pytestmark] == ["parametrize"]
    with pytest.raises(pytest.fail.Exception, match=f"client==1 is not installed.*{REQUIRE_ENV}"):
        decorated(1, "tmp")


def test_an_installed_client_runs_the_test_in_the_clients_lane(monkeypatch):
    monkeypatch.setenv(REQUIRE_ENV, "1")
    assert needs(PRESENT, "json")(_test) is _test
