"""What `pdserve up` refuses before it waits (pools the Ray cluster cannot hold), the cluster secret
it picks and never shows, Ray errors reduced to their cause, and the Supervisor's replacement of
dead workers (against fake actors: the real thing is in tests/e2e/test_deploy_ray.py). The router's
port against real listeners, and the CLI against a router or in a process of its own:
tests/integration/test_deploy_checks_ports_and_cli.py."""

from __future__ import annotations

import logging

import pytest

from pdserve.cli import main
from pdserve.deploy import launcher
from pdserve.deploy.config.load import validate_config
from pdserve.deploy.launcher import DeployError, Replica, RestartPolicy, Supervisor

SECRET = "s3cret-value-that-is-long-enough"


# ---- Ray's resources -------------------------------------------------------------------------------
def pools(prefill: dict, decode: dict):
    return validate_config({"pools": {"prefill": prefill, "decode": decode}})


def test_pools_that_cannot_fit_the_cluster_are_refused_with_what_to_lower():
    cfg = pools({"replicas": 2}, {"replicas": 2, "resources": {"num_cpus": 2}})
    with pytest.raises(DeployError) as e:
        launcher.check_resources(cfg, {"CPU": 2.0, "memory": 1e10}, [{"CPU": 2.0}], local=True)
    assert str(e.value) == (
        "the pools ask for 6 CPU (decode 2 x tp 1 x 2 CPU; prefill 2 x tp 1 x 1 CPU) but the Ray "
        "cluster has 2 CPU: lower pools.<pool>.replicas, .tp or .resources.num_cpus, or raise "
        "ray.num_cpus"
    )
    gpus = pools({"resources": {"num_gpus": 1}}, {"resources": {"num_gpus": 1}})
    with pytest.raises(DeployError, match=r"has 8 CPU, 0 GPU: .*\.num_gpus, or add Ray nodes"):
        launcher.check_resources(gpus, {"CPU": 8.0}, [{"CPU": 8.0}], local=False)


def test_cli_up_refuses_pools_a_local_ray_cannot_hold_before_starting_it(
    tmp_path, capsys, monkeypatch, tiny_models
):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called"))
    path = tmp_path / "big.yaml"
    path.write_text(
        f"model: {tiny_models('llama-gqa')[0]}\nrouter: {{port: 0}}\nray: {{num_cpus: 2}}\n"
        f"pools:\n  prefill: {{replicas: 2}}\n  decode: {{replicas: 2}}\n"
    )
    capsys.readouterr()
    assert main(["up", str(path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "pdserve: the pools ask for 4 CPU (decode 2 x tp 1 x 1 CPU; prefill 2 x tp 1 x 1 CPU) but "
        "the Ray cluster has 2 CPU: lower pools.<pool>.replicas, .tp or .resources.num_cpus, or "
        "raise ray.num_cpus"
    ]


def test_a_tp_group_must_fit_one_node():
    cfg = pools({"tp": 4, "resources": {"num_cpus": 1, "num_gpus": 1}}, {})
    nodes = [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 2.0}]
    with pytest.raises(DeployError) as e:  # 4 GPUs in the cluster, but 2 per node
        launcher.check_resources(cfg, {"CPU": 16.0, "GPU": 4.0}, nodes, local=False)
    assert str(e.value) == (
        "pools.prefill: one replica needs 4 CPU, 4 GPU on one node (tp 4 x 1 "
        "CPU, 1 GPU); the largest Ray node has 8 CPU, 2 GPU: lower "
        "pools.prefill.tp or pools.prefill.resources"
    )


def test_pools_that_fit_pass():
    cfg = pools({"resources": {"num_cpus": 0.5}}, {"replicas": 3, "resources": {"num_cpus": 0.5}})
    launcher.check_resources(cfg, {"CPU": 2.0}, [{"CPU": 2.0}], local=True)


# ---- the cluster secret ----------------------------------------------------------------------------
def test_up_makes_a_fresh_secret_when_none_is_given(caplog):
    caplog.set_level(logging.INFO, "pdserve.deploy")
    a = launcher.cluster_security(validate_config({}), {})
    b = launcher.cluster_security(validate_config({}), {})
    assert a.secret and b.secret and a.secret != b.secret and len(a.secret) >= 32
    assert a.tls is None
    assert "cluster secret: a fresh one for this deployment" in caplog.text
    assert a.secret not in caplog.text and a.secret not in repr(a)


def test_the_environment_gives_the_secret_unless_the_yaml_does(caplog):
    caplog.set_level(logging.INFO, "pdserve.deploy")
    env = {"PDSERVE_CLUSTER_SECRET": SECRET}
    assert launcher.cluster_security(validate_config({}), env).secret == SECRET
    yaml_secret = "the-yaml-secret-0123456789"
    chosen = launcher.cluster_security(
        validate_config({"security": {"cluster_secret": yaml_secret}}), env
    )
    assert chosen.secret == yaml_secret
    assert "PDSERVE_CLUSTER_SECRET is set, but security.cluster_secret wins" in caplog.text
    assert SECRET not in caplog.text and yaml_secret not in caplog.text


def test_a_short_secret_in_the_environment_is_refused_without_showing_it():
    with pytest.raises(DeployError) as e:
        launcher.cluster_security(validate_config({}), {"PDSERVE_CLUSTER_SECRET": "short-one"})
    assert str(e.value).startswith(
        "PDSERVE_CLUSTER_SECRET: the cluster secret must have at least 16"
    )
    assert "short-one" not in str(e.value)


def test_router_and_worker_configs_carry_the_secret_and_never_show_it():
    from pdserve.decode_worker.server import DecodeWorkerConfig
    from pdserve.prefill_worker.server import PrefillWorkerConfig
    from pdserve.router.server import RouterConfig

    security = launcher.cluster_security(validate_config({}), {"PDSERVE_CLUSTER_SECRET": SECRET})
    for cfg in (
        RouterConfig(model="m", security=security, deployment_id="d1"),
        DecodeWorkerConfig(model="m", security=security, deployment_id="d1"),
        PrefillWorkerConfig(model="m", security=security, deployment_id="d1"),
    ):
        assert cfg.security.secret == SECRET and cfg.deployment_id == "d1"
        assert SECRET not in repr(cfg) and SECRET not in str(cfg)


def test_worker_config_gets_the_deployments_secret_and_id():
    cfg = validate_config({})
    security = launcher.cluster_security(cfg, {"PDSERVE_CLUSTER_SECRET": SECRET})
    cluster = launcher.Cluster(
        cfg, False, registry_address="127.0.0.1:1", security=security, deployment_id="0123abcd"
    )
    for key, pool in cfg.worker_pools():
        wc = launcher._worker_config(cluster, key, pool, 0, "127.0.0.1")
        assert (wc.security, wc.deployment_id, wc.worker_id) == (security, "0123abcd", f"{key}-0")
    assert SECRET not in repr(cluster)


def test_a_local_workers_config_carries_neither_the_secret_nor_the_tls_key(tmp_path):
    """With workers on this machine (a SecretDir), the secret and the TLS private key go to them
    as 0600 files, not in their start arguments (which Ray keeps in its actor table)."""
    import dataclasses
    import os
    import stat

    from pdserve.deploy import secret_files
    from pdserve.protos.security import ClusterSecurity, TLSConfig

    cfg = validate_config({})
    tls = TLSConfig(b"CA PEM", b"CERT PEM", b"PRIVATE KEY PEM")
    security = ClusterSecurity(SECRET, tls)
    cluster = launcher.Cluster(
        cfg, False, registry_address="127.0.0.1:1", security=security, deployment_id="0123abcd"
    )
    cluster.secret_dir = secret_files.SecretDir(SECRET, parent=str(tmp_path), tls_key=tls.key_pem)
    try:
        for key, pool in cfg.worker_pools():
            wc = launcher._worker_config(cluster, key, pool, 0, "127.0.0.1")
            assert wc.security.secret is None
            assert wc.security.tls == dataclasses.replace(tls, key_pem=b"")
        key_file = cluster.secret_dir.path / secret_files.TLS_KEY_FILE
        assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
        secret_file = cluster.secret_dir.secret_file
        assert secret_files.tls_key_beside(secret_file) == b"PRIVATE KEY PEM"
        assert secret_files.read_secret_file(secret_file) == SECRET
    finally:
        cluster.secret_dir.remove()
    with pytest.raises(RuntimeError, match="cannot read the TLS key file"):
        secret_files.tls_key_beside(secret_file)


def test_stop_asks_only_started_actors_to_stop_and_kills_every_one(monkeypatch):
    """An actor never asked to start has only imported (its constructor may still run, under a
    start cut short by Ctrl-C): asking it to stop would wait for the constructor, so it is killed
    at once; one asked to start stops its worker first."""
    from pdserve.deploy.supervisor import Replica

    class Method:
        def __init__(self, calls, name):
            self.calls, self.name = calls, name

        def remote(self):
            self.calls.append(self.name)
            return self.name

    class Actor:
        def __init__(self, name):
            self.calls = []
            self.stop = Method(self.calls, f"stop {name}")

    waited, killed, removed = [], [], []
    monkeypatch.setattr(launcher.ray, "get", lambda ref, timeout=None: waited.append(ref))
    monkeypatch.setattr(launcher.ray, "kill", lambda actor: killed.append(actor))
    monkeypatch.setattr(launcher, "remove_placement_group", lambda pg: removed.append(pg))
    started, imported = Actor("started"), Actor("imported")
    cluster = launcher.Cluster(validate_config({}), False)
    cluster.replicas = [
        Replica("decode", 0, "pg0", actor=started, asked_to_start=True),
        Replica("prefill", 0, "pg1", actor=imported),
    ]
    cluster.stop()
    assert started.calls == ["stop started"] and imported.calls == []
    assert waited == ["stop started"]
    assert killed == [started, imported] and removed == ["pg0", "pg1"]
    assert cluster.replicas == []


# ---- Ray errors --------------------------------------------------------------------------------------
def test_ray_errors_are_reduced_to_their_cause():
    from ray.exceptions import RayActorError, RayTaskError

    task = RayTaskError(
        "start",
        "Traceback (most recent call last):\n  ...\nValueError: x",
        ValueError("kv_cache_memory=1 gives 0 blocks: raise kv_cache_memory"),
    )
    assert (
        launcher.ray_error_reason(task)
        == "ValueError: kv_cache_memory=1 gives 0 blocks: raise kv_cache_memory"
    )
    assert launcher.ray_error_reason(task.as_instanceof_cause()) == launcher.ray_error_reason(task)
    died = RayActorError(
        error_msg="The actor died unexpectedly before finishing this task.\n\tpid: 7"
    )
    assert (
        launcher.ray_error_reason(died) == "The actor died unexpectedly before finishing this task."
    )


# ---- the Supervisor, against fake actors ---------------------------------------------------------
class Ref:
    def __init__(self, value=None, error: BaseException | None = None, ready: bool = True):
        self.value, self.error, self.ready = value, error, ready


class Method:
    def __init__(self, actor, name):
        self.actor, self.name = actor, name

    def remote(self, *args):
        self.actor.calls.append((self.name, args))
        return self.actor.answer(self.name)


class FakeActor:
    """Answers start/ping from a script: "ok", "dead" (RayActorError) or "raise" (RayTaskError)."""

    launched = 0

    def __init__(self, start="ok", ping="ok"):
        FakeActor.launched += 1
        self.mode = {"start": start, "ping": ping}
        self.calls = []  # (method, arguments) as called
        self.start, self.ping = Method(self, "start"), Method(self, "ping")

    def answer(self, name):
        from ray.exceptions import RayActorError, RayTaskError

        mode = self.mode[name]
        if mode == "dead":
            return Ref(error=RayActorError(error_msg="The actor died unexpectedly"))
        if mode == "raise":
            return Ref(error=RayTaskError("start", "tb", ValueError("no KV")))
        # start: (address, the engine's mode note), as WorkerActor.start returns
        return Ref(
            (f"127.0.0.1:{FakeActor.launched}", "quantization=none") if name == "start" else True
        )


@pytest.fixture
def fake_ray(monkeypatch):
    clock = [1000.0]

    def get(ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.value

    monkeypatch.setattr(
        launcher.ray,
        "wait",
        lambda refs, timeout=None: ([r for r in refs if r.ready], [r for r in refs if not r.ready]),
    )
    monkeypatch.setattr(launcher.ray, "get", get)
    monkeypatch.setattr(launcher.ray, "kill", lambda actor: None)
    monkeypatch.setattr(launcher.time, "monotonic", lambda: clock[0])
    FakeActor.launched = 0
    return clock


def serving_replica(clock, spawn) -> Replica:
    r = Replica("decode", 0, pg=None, actor=FakeActor(), address="127.0.0.1:0", spawn=spawn)
    r.serving_since = clock[0]
    return r


def test_a_dead_worker_is_replaced_once_and_logged_once(fake_ray, caplog):
    clock = fake_ray
    r = serving_replica(clock, spawn=FakeActor)
    sup = Supervisor([r], RestartPolicy(backoff_s=1, stable_s=60), "127.0.0.1:50051")
    clock[0] += 3600  # long after it started: not a quick death
    r.actor.mode["ping"] = "dead"
    sup.check(r)  # sends a ping
    sup.check(r)  # reads it: dead
    assert r.actor is None and r.address is None and r.quick_deaths == 0
    sup.check(r)
    assert r.actor is None  # waits backoff_s before the relaunch
    clock[0] += 1
    sup.check(r)  # relaunched, starting
    assert r.actor is not None and r.start_ref is not None and FakeActor.launched == 2
    assert r.actor.calls == [("start", ("127.0.0.1:50051",))]  # joins the same router
    sup.check(r)  # start returned
    assert r.address == "127.0.0.1:2" and r.serving_since == clock[0]
    for _ in range(5):
        sup.check(r)
    assert FakeActor.launched == 2
    died = [m for m in caplog.messages if "died" in m]
    replaced = [m for m in caplog.messages if "replaced" in m]
    assert died == ["worker decode-0 died (The actor died unexpectedly); replacing it in 1s"]
    assert replaced == ["worker decode-0 replaced: serving on 127.0.0.1:2; quantization=none"]


def test_a_worker_dying_right_after_each_start_is_given_up_on(fake_ray, caplog):
    clock = fake_ray
    r = serving_replica(clock, spawn=lambda: FakeActor(start="raise"))
    sup = Supervisor(
        [r],
        RestartPolicy(backoff_s=1, max_backoff_s=1.5, stable_s=60, max_quick_deaths=3),
        "127.0.0.1:50051",
    )
    r.actor.mode["ping"] = "dead"
    delays = []
    for _ in range(100):
        before = r.retry_at
        sup.check(r)
        if r.retry_at != before:
            delays.append(r.retry_at - clock[0])
        clock[0] += 0.5
    assert r.given_up and r.actor is None
    assert delays == [1, 1.5]  # 1 x 2^0, then 2^1 capped at 1.5; the third gives up
    assert FakeActor.launched == 3  # the first actor, then two relaunches
    assert sum("giving up on it" in m for m in caplog.messages) == 1
    assert (
        "worker decode-0 failed to start (ValueError: no KV); giving up on it: 3 deaths in a "
        "row within 60s of starting" in caplog.text
    )


def test_a_busy_worker_is_not_dead(fake_ray):
    clock = fake_ray
    r = serving_replica(clock, spawn=FakeActor)
    sup = Supervisor([r], RestartPolicy(), "127.0.0.1:50051")
    r.actor.answer = lambda name: Ref(ready=False)  # a ping that never comes back
    for _ in range(10):
        sup.check(r)
        clock[0] += 10
    assert r.actor is not None and r.address == "127.0.0.1:0" and FakeActor.launched == 1


# ---- a started worker's exit watch (deploy/workers.py ExitWatch) ---------------------------------
def test_a_broken_engine_exits_at_once_and_a_stuck_worker_after_its_bound():
    from pdserve.deploy.workers import ExitWatch

    watch = ExitWatch(exit_s=60, drain_s=600)
    assert watch.reason("", "", False, 0.0) == ""
    assert watch.reason("rank 1 died", "", True, 1.0) == "rank 1 died"
    stuck = "1 reservation(s) held past the KV write bound of 95 s"
    assert watch.reason("", stuck, False, 10.0) == ""  # unhealthy from now
    assert watch.reason("", stuck, False, 69.0) == ""
    assert watch.reason("", "", False, 69.5) == ""  # the claim ended after all: healthy again
    assert watch.reason("", stuck, False, 70.0) == ""  # a new stretch starts here
    assert watch.reason("", stuck, False, 129.0) == ""
    assert watch.reason("", stuck, False, 130.0) == f"unhealthy for 60s: {stuck}"
    # streams still decoding are let finish, for at most drain_s more
    watch = ExitWatch(exit_s=60, drain_s=600)
    assert watch.reason("", stuck, True, 0.0) == ""
    assert watch.reason("", stuck, True, 61.0) == ""
    assert watch.reason("", stuck, False, 100.0) == f"unhealthy for 100s: {stuck}"  # they ended
    watch = ExitWatch(exit_s=60, drain_s=600)
    assert watch.reason("", stuck, True, 0.0) == ""
    assert watch.reason("", stuck, True, 659.0) == ""
    assert watch.reason("", stuck, True, 660.0) == (
        f"unhealthy for 660s, cutting the streams it still decoded: {stuck}"
    )


def test_a_worker_is_unhealthy_while_its_decode_part_holds_blocks_past_the_bound():
    from types import SimpleNamespace

    from pdserve.decode_worker.server import DecodePart
    from pdserve.worker_common.process import WorkerProcess

    part = DecodePart.__new__(DecodePart)  # only its handoff matters here
    part.role, part.handoff = "decode", None
    worker = WorkerProcess.__new__(WorkerProcess)
    worker.parts = {"decode": part, "prefill": SimpleNamespace(role="prefill")}
    assert worker.unhealthy() == ""  # not started: no handoff yet
    part.handoff = SimpleNamespace(unhealthy="")
    assert worker.unhealthy() == ""
    part.handoff = SimpleNamespace(unhealthy="2 reservation(s) held past the bound")
    assert worker.unhealthy() == "2 reservation(s) held past the bound"
