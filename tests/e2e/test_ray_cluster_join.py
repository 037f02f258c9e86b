"""`pdserve up --address` against a Ray cluster made as an operator makes one (issue #28, must-show
a): `ray start --head` with token authentication, and a second `ray start` node with a custom
resource, both on this machine standing in for two hosts, each with its own ports, in a temp dir of
this test. `pdserve up` runs as a command with RAY_AUTH_MODE unset and the token only where Ray's
clients look for it (RAY_AUTH_TOKEN_PATH); its decode pool is pinned to the second node by the
custom resource. Greedy tokens through its router equal the engine's alone, its console shows each
worker's start stages and the start table, and Ray's actor table has the decode actor, named
decode-0, on the second node (read from the GCS: `ray list actors` and ray.util.state need the
dashboard, which the `ray` this project installs has no packages for). Without a token, `up` fails
at once in one line that says what to set.

Each `ray start` runs in a session of its own; the test kills only the processes of those sessions
(RayNodes), never with `ray stop` (which would end every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
import yaml

from helpers.ray_nodes import RayNodes, ask_ray, free_ports, read_until_table, up_command

pytestmark = [
    pytest.mark.slow,
    # two clusters of `ray start` nodes starting at once on two cores overran Ray's node
    # registration wait (a run with four test processes): one such test at a time
    pytest.mark.exclusive("ray-nodes"),
    pytest.mark.skipif(sys.platform != "linux", reason="finds its Ray processes in /proc"),
]

MAX_TOKENS = 16
KV_BYTES = 4 << 20
START_TIMEOUT_S = 240.0


def _engine_tokens(model_dir: str, prompt_ids: list[int]) -> list[int]:
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", kv_cache_memory=KV_BYTES)
    out = llm.generate(
        prompt_ids,
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    llm.shutdown()
    return list(out[0].outputs[0].token_ids)


def _served_tokens(router: str, prompt_ids: list[int]) -> list[int]:
    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt_ids),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    with grpc.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.PDServeStub(channel)
        return [
            t
            for resp in stub.Generate(request, timeout=60)
            if resp.HasField("delta")
            for t in resp.delta.token_ids
        ]


def test_up_joins_a_token_cluster_and_pins_decode_to_the_second_node(tiny_models, tmp_path):
    from helpers.models import random_prompts

    t0 = time.perf_counter()
    model_dir, _ = tiny_models("llama-gqa")
    prompt_ids = random_prompts([23], seed=5)[0]
    want = _engine_tokens(model_dir, prompt_ids)
    assert len(want) == MAX_TOKENS

    token = tmp_path / "ray_token"
    token.write_text(uuid.uuid4().hex)
    ray_tmp = tempfile.mkdtemp(prefix="pdray")  # short: Ray's socket paths live under it
    cluster = RayNodes(ray_tmp, token)
    pool = {"replicas": 1, "tp": 1, "kv_cache_memory": KV_BYTES}
    config = tmp_path / "two-nodes.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": model_dir,
                "dtype": "float32",
                "pools": {
                    "prefill": {**pool, "resources": {"num_cpus": 1}},
                    "decode": {**pool, "resources": {"num_cpus": 1, "node2": 1}},
                },
                "router": {"host": "127.0.0.1", "port": 0, "http_port": None},
            }
        )
    )
    # as an operator's shell: no RAY_AUTH_MODE, the token where Ray's clients look for it
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    up = None
    try:
        head_port, client_port = free_ports(2)
        head_args = ["--head", "--port", str(head_port), "--temp-dir", ray_tmp]
        head_args += ["--include-dashboard", "false", "--ray-client-server-port", str(client_port)]
        cluster.start(*head_args)
        address = f"127.0.0.1:{head_port}"
        cluster.start("--address", address, "--resources", json.dumps({"node2": 1}))
        t_ray = time.perf_counter() - t0

        # no token anywhere: one line saying what to set, at once
        no_home = tmp_path / "home"
        no_home.mkdir()
        refused = subprocess.run(
            [sys.executable, "-m", "pdserve", "up", str(config), "--address", address],
            env={**env, "HOME": str(no_home)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode == 2, refused.stderr[-2000:]
        errors = [x for x in refused.stderr.splitlines() if x.startswith("pdserve:")]
        assert errors == [
            f"pdserve: the Ray cluster at {address} (ray.address, --address) requires token "
            "authentication and no token was found: put the head's token (`ray get-auth-token` "
            "on the head node prints it) in ~/.ray/auth_token, or set RAY_AUTH_TOKEN to it, or "
            "RAY_AUTH_TOKEN_PATH to a file holding it"
        ], refused.stderr[-2000:]
        assert "InvalidAuthToken" not in refused.stderr

        err = tmp_path / "up.err"
        up = up_command(config, address, {**env, "RAY_AUTH_TOKEN_PATH": str(token)}, err)
        out = read_until_table(up, START_TIMEOUT_S)
        assert "ready" in out, f"{out}\n{err.read_text()[-3000:]}"
        t_up = time.perf_counter() - t0 - t_ray
        router = next(x.split()[-1] for x in out if x.startswith("router on "))
        assert _served_tokens(router, prompt_ids) == want

        state = ask_ray(cluster, address)
        node2 = [n["node"] for n in state["nodes"] if n["resources"].get("node2")]
        head = [n["node"] for n in state["nodes"] if not n["resources"].get("node2")]
        assert len(node2) == 1 and len(head) == 1, state["nodes"]
        alive = {a["name"]: a["node"] for a in state["actors"] if a["state"] == "ALIVE"}
        assert alive == {"decode-0": node2[0], "prefill-0": head[0]}, state["actors"]

        # the start table names the same nodes; the console showed each worker's stages
        table = out[out.index("ready") + 1 :]
        assert table[0].split()[:3] == ["worker", "role", "node"], table
        rows = {line.split()[0]: line for line in table[1:]}
        assert f" ({node2[0][:8]}) " in rows["decode-0"], table
        assert f" ({head[0][:8]}) " in rows["prefill-0"], table
        assert " grpc " in rows["decode-0"] and " float32 " in rows["decode-0"], table
        log_file = rows["decode-0"].split()[-1]
        assert log_file.startswith(ray_tmp) and pathlib.Path(log_file).is_file(), table
        console = err.read_text()
        assert "token authentication, the token from RAY_AUTH_TOKEN_PATH" in console
        for stage in ("model files", "weights", "KV capacity", "precision probe", "warm-up"):
            assert any(
                "decode-0: " in line and f"s {stage}: " in line for line in console.splitlines()
            ), (stage, console[-3000:])
        assert "decode-0 start:" in pathlib.Path(log_file).read_text()  # the worker's own log
    finally:
        stop = "exited before the test stopped it"
        if up is not None and up.poll() is None:
            up.send_signal(signal.SIGINT)  # Ctrl-C: stops its actors and leaves the cluster
            t_stop = time.perf_counter()
            try:
                up.wait(240)  # returns when `up` exits; stopping took over 60 s on a loaded machine
                stop = f"exited {time.perf_counter() - t_stop:.1f}s after SIGINT"
            except subprocess.TimeoutExpired:
                stop = "still running 240s after SIGINT; its threads' stacks follow, then a kill"
                up.send_signal(signal.SIGUSR1)  # `up` writes every thread's stack to stderr
                time.sleep(3)
                up.kill()
                up.wait()
        cluster.kill()
        import shutil

        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert up.returncode == 0, f"exit status {up.returncode}, {stop}\n{err.read_text()[-8000:]}"
    assert cluster.processes() == []
    print(
        f"ray start x2: {t_ray:.1f}s; up to served: {t_up:.1f}s; all {time.perf_counter() - t0:.1f}s"
    )
