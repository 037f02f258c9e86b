"""A local Ray that starts too slowly is killed and started once more (deploy/ray_connect.py):
on a loaded 2-core machine Ray's own 30 s waits for the GCS port and the raylet have run out.
Its workers run at niceness 0, and a worker process Ray niced brings itself back where it may
(deploy/workers.py). ray.init is replaced here; no Ray starts. That a timed-out try's processes are killed:
tests/integration/test_ray_reaper_processes.py."""

from __future__ import annotations

import os

import pytest
import ray

from pdserve.deploy import ray_connect

RAYLET_TIMEOUT = (
    "The current node timed out during startup. This could happen because some of the raylet "
    "failed to startup or the GCS has become overloaded."
)


@pytest.fixture
def calls(monkeypatch, tmp_path):
    """Each ray.init call's kwargs; ray.init raises the queued errors in turn, then succeeds.
    HOME is a temp dir (the start writes a Ray token there); `during` records, per call, Ray's
    local-only switch as ray.init saw it (the constant, and the variable its processes inherit)."""
    from ray._private import ray_constants

    record = {"kwargs": [], "errors": [], "killed": [], "during": []}
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)

    def fake_init(**kwargs):
        record["kwargs"].append(kwargs)
        record["during"].append(
            (ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(ray_connect.LOCAL_ONLY_ENV))
        )
        if record["errors"]:
            raise record["errors"].pop(0)
        return "context"

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray_connect.ray_reaper, "kill_recorded", record["killed"].append)
    monkeypatch.delenv("RAY_gcs_server_port_wait_time_s", raising=False)
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    monkeypatch.delenv("RAY_prestart_worker_first_driver", raising=False)
    return record


def test_a_timed_out_start_is_tried_once_more(calls):
    calls["errors"].append(Exception(RAYLET_TIMEOUT))
    context, _ = ray_connect.start_local_ray(num_cpus=2)
    assert context == "context"
    normal = {"worker_niceness": 0, "prestart_worker_first_driver": False}
    loopback = {"_node_ip_address": "127.0.0.1"}
    assert calls["kwargs"] == [{"num_cpus": 2, "_system_config": normal, **loopback}] * 2
    assert len(calls["killed"]) == 1  # what the first try started was killed before the second
    assert os.environ["RAY_gcs_server_port_wait_time_s"] == str(ray_connect.GCS_PORT_WAIT_S)


def test_two_timeouts_give_up_saying_so(calls):
    calls["errors"] += [RuntimeError("Timed out waiting for file /tmp/x/gcs_server_port")] * 2
    with pytest.raises(RuntimeError, match="timed out 2 times: Timed out waiting for file"):
        ray_connect.start_local_ray()
    assert len(calls["kwargs"]) == 2


def test_other_failures_are_not_retried(calls):
    calls["errors"].append(ValueError("num_cpus must be positive"))
    with pytest.raises(ValueError, match="num_cpus"):
        ray_connect.start_local_ray(num_cpus=-1)
    assert len(calls["kwargs"]) == 1


def test_workers_run_at_niceness_0_and_none_idle_unless_the_operator_chose(calls, monkeypatch):
    ray_connect.start_local_ray(_system_config={"object_timeout_milliseconds": 5})
    assert calls["kwargs"][-1]["_system_config"] == {
        "worker_niceness": 0,
        "prestart_worker_first_driver": False,
        "object_timeout_milliseconds": 5,
    }
    ray_connect.start_local_ray(_system_config={"worker_niceness": 5})
    assert calls["kwargs"][-1]["_system_config"] == {
        "worker_niceness": 5,
        "prestart_worker_first_driver": False,
    }
    monkeypatch.setenv("RAY_worker_niceness", "10")
    ray_connect.start_local_ray()
    assert calls["kwargs"][-1]["_system_config"] == {"prestart_worker_first_driver": False}
    monkeypatch.setenv("RAY_prestart_worker_first_driver", "1")
    ray_connect.start_local_ray()
    assert "_system_config" not in calls["kwargs"][-1]


def test_a_niced_worker_thread_comes_back_to_0_where_it_may():
    """Raising one's niceness is always allowed, lowering it needs privilege: a thread niced to 5
    comes back to 0 as root and, without the privilege, stays at 5 and says so. On Linux
    niceness is per thread, so a thread of its own keeps the test process untouched."""
    import threading

    from pdserve.deploy.workers import at_normal_priority

    seen = {}

    def run():
        os.setpriority(os.PRIO_PROCESS, 0, 5)
        seen["returned"] = at_normal_priority()
        seen["now"] = os.getpriority(os.PRIO_PROCESS, 0)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen["returned"] == seen["now"] and seen["now"] in (0, 5)
    if os.geteuid() == 0:
        assert seen["now"] == 0


def test_an_operator_s_gcs_wait_is_kept(calls, monkeypatch):
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "600")
    ray_connect.start_local_ray()
    assert os.environ["RAY_gcs_server_port_wait_time_s"] == "600"


def test_a_local_ray_starts_on_loopback_unless_asked_otherwise(calls, tmp_path):
    """Ray's local-only mode is on while ray.init runs (node IP 127.0.0.1: Ray binds every server
    there) and off again after; with loopback=False Ray's own choice stands."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_connect.start_local_ray()
    assert calls["during"][-1] == (False, "0")
    assert calls["kwargs"][-1]["_node_ip_address"] == "127.0.0.1"
    assert ray_constants.ENABLE_RAY_CLUSTER == before
    assert ray_connect.LOCAL_ONLY_ENV not in os.environ
    ray_connect.start_local_ray(loopback=False)
    assert calls["during"][-1] == (before, None)
    assert "_node_ip_address" not in calls["kwargs"][-1]


def test_the_token_a_local_start_would_make_is_written_0600(calls, tmp_path):
    ray_connect.start_local_ray()
    token = tmp_path / ".ray" / "auth_token"
    assert len(token.read_text().strip()) >= 32
    assert oct(token.stat().st_mode & 0o777) == oct(0o600)
    assert oct(token.parent.stat().st_mode & 0o777) == oct(0o700)
