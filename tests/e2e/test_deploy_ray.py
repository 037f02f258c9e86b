"""`up()` on a local Ray (the `pdserve up` code path): 1 prefill + 1 decode actor and the router,
or two colocated workers over mutual TLS; a client's greedy Generate through the router equals the
in-process engine's tokens. The disaggregated deployment then heals itself: kill -9 the only
decode worker, requests get UNAVAILABLE, then its replacement registers and serves the same
tokens, with nobody restarting anything (one deployment for both: each `up` costs CI ~25 s)."""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import signal
import time

import pytest

from helpers.threads import wait_until
from helpers.up import ray_temp_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("router") is None
        or importlib.util.find_spec("pdserve.router.server") is None,
        reason="router not available",
    ),
]

MAX_TOKENS = 16
KV_BYTES = 4 << 20


def _engine_tokens(model_dir, prompt_ids) -> list[int]:
    """The in-process engine's greedy tokens of `prompt_ids`."""
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(model_dir, kv_cache_memory=KV_BYTES)
    want = llm.generate(
        prompt_ids,
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    llm.shutdown()
    assert len(want[0].outputs[0].token_ids) == MAX_TOKENS
    return list(want[0].outputs[0].token_ids)


def test_colocated_up_generates_over_mutual_tls_and_stops(tiny_models, tmp_path):
    import ray

    from helpers.models import random_prompts
    from helpers.tls import tls_files
    from pdserve.deploy.config.load import validate_config
    from pdserve.deploy.launcher import up
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    model_dir, _ = tiny_models("llama-gqa")
    prompt_ids = random_prompts([23], seed=5)[0]
    want = _engine_tokens(model_dir, prompt_ids)
    # a short private temp dir: Ray's Unix socket paths live under it and have a length limit
    with ray_temp_dir() as ray_tmp:
        pool = {"replicas": 2, "tp": 1, "resources": {"num_cpus": 1}, "kv_cache_memory": KV_BYTES}
        # mutual TLS between the deployment's processes, whose private key the workers read from an
        # owner-only file, never from their start arguments
        files = tls_files(tmp_path)
        config = validate_config(
            {
                "model": model_dir,
                "pools": {"colocated": pool},
                "router": {"port": 0},
                "ray": {"num_cpus": 2, "temp_dir": ray_tmp},
                "security": {"tls": {k + "_file": str(files[k]) for k in ("ca", "cert", "key")}},
            }
        )
        t0 = time.perf_counter()
        cluster = up(config, block=False)
        try:
            t_up = time.perf_counter() - t0
            assert (len(cluster.addresses("decode")), len(cluster.addresses("prefill"))) == (2, 0)
            # Ray would run them at niceness 15: a thirtieth of a core beside any busy process
            assert [r.info["niceness"] for r in cluster.replicas] == [0, 0]
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt_ids),
                sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
            )
            got, finish = [], None
            # the router's port takes TLS clients only
            with cluster.security.channel(cluster.router_address) as channel:
                stub = pdserve_pb2_grpc.PDServeStub(channel)
                for resp in stub.Generate(request, timeout=60):
                    if resp.HasField("delta"):
                        got += list(resp.delta.token_ids)
                    else:
                        finish = resp.finish
            assert got == want
            assert finish is not None and finish.finish_reason == "length", finish
        finally:
            cluster.stop()
    assert not ray.is_initialized()  # up() started this Ray, so stop() shut it down
    print(f"colocated: up {t_up:.1f}s, total {time.perf_counter() - t0:.1f}s")


SECRET = "e2e-cluster-secret-0123456789"


def _generate(stub, prompt_ids):
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb

    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt_ids),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    return [
        t
        for resp in stub.Generate(request, timeout=30)
        if resp.HasField("delta")
        for t in resp.delta.token_ids
    ]


def _admin_sees_both_roles(cluster) -> None:
    """The Admin service lists the disaggregated deployment's two workers serving their roles,
    and refuses to flip the only decode worker."""
    import grpc

    from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

    with cluster.security.channel(cluster.router_address) as channel:
        admin = worker_pb2_grpc.AdminStub(channel)

        def listed():
            return admin.ListWorkers(worker_pb2.ListWorkersRequest(), timeout=10).workers

        # each worker's first Stats reaches the router within a health sweep or two
        wait_until(lambda: all(w.HasField("stats") for w in listed()), 10, "Stats")
        assert [(w.worker_id, w.role, w.state, w.stats.role) for w in listed()] == [
            ("decode-0", "decode", "serving", "decode"),
            ("prefill-0", "prefill", "serving", "prefill"),
        ]
        with pytest.raises(grpc.RpcError, match="decode pool empty"):
            admin.Flip(worker_pb2.FlipRequest(worker_id="decode-0", role="prefill"))


def test_disaggregated_up_serves_heals_a_killed_decode_worker_and_stops(tiny_models, caplog):
    import grpc
    import ray

    from helpers.models import random_prompts
    from pdserve.deploy.config.load import validate_config
    from pdserve.deploy.launcher import RestartPolicy, up
    from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc

    caplog.set_level(logging.INFO, "pdserve.deploy")
    model_dir, _ = tiny_models("llama-gqa")
    prompt_ids = random_prompts([23], seed=5)[0]
    engine_tokens = _engine_tokens(model_dir, prompt_ids)
    with ray_temp_dir() as ray_tmp:
        pool = {"replicas": 1, "tp": 1, "resources": {"num_cpus": 1}, "kv_cache_memory": KV_BYTES}
        config = validate_config(
            {
                "model": model_dir,
                "pools": {"prefill": pool, "decode": pool},
                "router": {"port": 0},
                "ray": {"num_cpus": 2, "temp_dir": ray_tmp},
            }
        )
        t0 = time.perf_counter()
        cluster = up(
            config,
            block=False,
            restart=RestartPolicy(poll_s=0.2, backoff_s=0.5),
            environ={"PDSERVE_CLUSTER_SECRET": SECRET},
        )
        try:
            t_up = time.perf_counter() - t0
            assert cluster.security.secret == SECRET and len(cluster.deployment_id) == 32
            assert (len(cluster.addresses("decode")), len(cluster.addresses("prefill"))) == (1, 1)
            assert [r.info["niceness"] for r in cluster.replicas] == [0, 0]
            _admin_sees_both_roles(cluster)
            with grpc.insecure_channel(cluster.router_address) as channel:
                # the control plane needs the secret; the client API does not
                register = worker_pb2.RegisterRequest(
                    worker_id="decode-0", role="decode", address="127.0.0.1:1"
                )
                with pytest.raises(grpc.RpcError) as e:
                    worker_pb2_grpc.RegistryStub(channel).Register(register, timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                stub = pdserve_pb2_grpc.PDServeStub(channel)
                want = _generate(stub, prompt_ids)
                assert want == engine_tokens

                decode = next(r for r in cluster.replicas if r.key == "decode")
                old_actor, old_address = decode.actor, decode.address
                os.kill(ray.get(decode.actor.pid.remote(), timeout=30), signal.SIGKILL)
                t_kill = time.perf_counter()
                failures, got = [], None
                while got is None:  # nobody but the launcher's supervisor does anything from here
                    assert time.perf_counter() - t_kill < 60, (
                        f"not served again within 60 s: {failures}"
                    )
                    try:
                        got = _generate(stub, prompt_ids)
                    except grpc.RpcError as err:
                        failures.append(err.code())
                        time.sleep(0.2)
                t_back = time.perf_counter() - t_kill
            assert failures and set(failures) == {grpc.StatusCode.UNAVAILABLE}, failures
            assert got == want
            # the replacement registers with the router from inside its start(); the supervisor
            # records its address on its next poll after start() returns (every 0.2 s)
            wait_until(
                lambda: decode.address not in (None, old_address),
                10,
                "the supervisor records the replacement's address",
            )
            assert decode.actor is not old_actor
            assert cluster.router.pool.num_workers("decode") == 1
            died = [m for m in caplog.messages if m.startswith("worker decode-0 died")]
            replaced = [m for m in caplog.messages if m.startswith("worker decode-0 replaced")]
            assert len(died) == 1 and len(replaced) == 1, caplog.messages
            assert not any("prefill-0" in m for m in died + replaced)
        finally:
            cluster.stop()
        assert not ray.is_initialized()  # up() started this Ray, so stop() shut it down
        # the secret is in no log line, here or in any file Ray wrote
        assert SECRET not in caplog.text
        leaked = [
            str(p)
            for p in pathlib.Path(ray_tmp).rglob("*")
            if p.is_file() and not p.is_socket() and SECRET.encode() in p.read_bytes()
        ]
        assert not leaked
    print(
        f"up {t_up:.1f}s, served again {t_back:.1f}s after the kill "
        f"({len(failures)} requests failed meanwhile)"
    )


def test_a_worker_that_fails_to_start_is_one_line_naming_its_pool(
    tiny_models, tmp_path, capsys, monkeypatch
):
    """A misfit the launcher cannot see beforehand (here: its fit check is switched off) fails
    inside the actor; `pdserve up` prints the engine's own reason under the pool's key, exit 2."""
    import ray

    from pdserve.cli import main
    from pdserve.deploy import launcher, prechecks

    # both places that check the fit before Ray starts: `up`'s preflight and the launcher's own
    monkeypatch.setattr(prechecks, "check_model_fit", lambda *a, **k: None)
    monkeypatch.setattr(launcher, "check_model_fit", lambda *a, **k: None)
    model_dir, _ = tiny_models("llama-gqa")
    with ray_temp_dir() as ray_tmp:
        path = tmp_path / "small-kv.yaml"
        path.write_text(
            f"model: {model_dir}\nrouter: {{port: 0}}\n"
            f"ray: {{num_cpus: 1, temp_dir: {ray_tmp}}}\n"
            f"pools:\n  colocated: {{kv_cache_memory: 1000, max_model_len: 64}}\n"
        )
        capsys.readouterr()
        t0 = time.perf_counter()
        assert main(["up", str(path)]) == 2
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("pdserve:")]
    assert len(ours) == 1 and "Traceback" not in err, err
    assert ours[0].startswith(
        "pdserve: pools.colocated: replica 0 failed to start: ValueError: "
        "kv_cache_memory=1000 gives 0 blocks"
    ), ours
    assert ours[0].endswith("raise kv_cache_memory or lower max_model_len")
    assert not ray.is_initialized()  # everything it started is stopped
    print(f"refused in {time.perf_counter() - t0:.1f}s")
