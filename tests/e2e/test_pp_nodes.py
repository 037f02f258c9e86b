"""A prefill pool whose two pipeline stages sit on two Ray nodes (issue #53, must-show d's second
half): `ray start --head` and a second `ray start`, both on this machine standing in for two hosts
(the cluster of tests/e2e/test_ray_cluster_join.py: token authentication, ports of their own), one
CPU each. The prefill pool is PP 2 with 0.6 CPU per rank, so no node holds both of a worker's
stages and Ray's PACK strategy spreads them (deploy/placement.py); rank 1 runs as a Ray actor on
its own bundle (deploy/rank_actors.py). Asserted: Ray's actor table has prefill-0 (stage 0) and
prefill-0-rank1 (stage 1) on different nodes, the start table names both, greedy tokens through
the router equal the engine's PP=1 tokens in one process. Then stage 1's process is killed: the
worker's engine breaks, the worker exits and is replaced with a fresh rank actor, and the same
tokens are served again. After Ctrl-C no actor of the deployment is alive and `up` exited 0.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import time
import uuid

import grpc
import pytest
import yaml

from helpers.models import make_tiny_model, random_prompts
from helpers.process import command_of
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


def _engine_tokens(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    """The engine's greedy tokens in this process, one stage."""
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", kv_cache_memory=KV_BYTES)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate(prompts, greedy, use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in out]


def _generate(router: str, prompt_ids: list[int]) -> tuple[list[int], str]:
    """The greedy tokens the router serves, and the prefill worker it names in the timings."""
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt_ids),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    tokens, prefill_worker = [], ""
    with grpc.insecure_channel(router) as channel:
        for resp in pdserve_pb2_grpc.PDServeStub(channel).Generate(request, timeout=60):
            if resp.HasField("delta"):
                tokens += resp.delta.token_ids
            elif resp.HasField("finish"):
                prefill_worker = resp.finish.timings.prefill_worker
    return tokens, prefill_worker


def test_a_pp2_prefill_pool_spans_two_ray_nodes_and_serves_the_pp1_tokens(tmp_path):
    t0 = time.perf_counter()
    model_dir = str(tmp_path / "tiny4")
    make_tiny_model(model_dir, "llama-gqa", seed=7, num_hidden_layers=4)
    # a fresh prompt each time: one the decode worker holds could be prefilled there instead
    # (router.local_prefill), and these must go through the prefill worker's stages
    prompt_ids, again = random_prompts([29, 31], seed=53)
    want, want_again = _engine_tokens(model_dir, [prompt_ids, again])  # PP 1, one process
    assert len(want) == MAX_TOKENS

    token = tmp_path / "ray_token"
    token.write_text(uuid.uuid4().hex)
    ray_tmp = tempfile.mkdtemp(prefix="pdray")  # short: Ray's socket paths live under it
    cluster = RayNodes(ray_tmp, token)
    small = {"replicas": 1, "num_threads": 1, "kv_cache_memory": KV_BYTES}
    config = tmp_path / "pp-two-nodes.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": model_dir,
                "dtype": "float32",
                "pools": {
                    # 2 x 0.6 CPU: more than one node's 1 CPU, so the stages go to two nodes
                    "prefill": {**small, "pp": 2, "resources": {"num_cpus": 0.6}},
                    "decode": {**small, "resources": {"num_cpus": 0.4}},
                },
                "router": {"host": "127.0.0.1", "port": 0, "http_port": None},
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["RAY_AUTH_TOKEN_PATH"] = str(token)
    up = None
    err = tmp_path / "up.err"
    try:
        head_port, client_port = free_ports(2)
        head_args = ["--head", "--port", str(head_port), "--temp-dir", ray_tmp]
        head_args += ["--include-dashboard", "false", "--ray-client-server-port", str(client_port)]
        cluster.start(*head_args)
        address = f"127.0.0.1:{head_port}"
        cluster.start("--address", address, "--resources", json.dumps({"node2": 1}))
        t_ray = time.perf_counter() - t0

        up = up_command(config, address, env, err)
        out = read_until_table(up, START_TIMEOUT_S)
        assert "ready" in out, f"{out}\n{err.read_text()[-5000:]}"
        t_up = time.perf_counter() - t0 - t_ray
        router = next(x.split()[-1] for x in out if x.startswith("router on "))
        assert _generate(router, prompt_ids) == (want, "prefill-0")

        state = ask_ray(cluster, address)
        assert len(state["nodes"]) == 2, state["nodes"]
        alive = {a["name"]: a["node"] for a in state["actors"] if a["state"] == "ALIVE"}
        assert set(alive) == {"prefill-0", "prefill-0-rank1", "decode-0"}, state["actors"]
        stage0, stage1 = alive["prefill-0"], alive["prefill-0-rank1"]
        assert stage0 != stage1, state["actors"]  # the two stages on two Ray nodes
        assert {stage0, stage1} == {n["node"] for n in state["nodes"]}

        # the start table names both stages' nodes on the prefill worker's row
        table = out[out.index("ready") + 1 :]
        rows = {line.split()[0]: line for line in table[1:]}
        assert f" ({stage0[:8]}), stage 1: " in rows["prefill-0"], table
        assert f" ({stage1[:8]}) " in rows["prefill-0"].split(", stage 1: ")[1], table
        assert ", pp 2 " in rows["prefill-0"], table

        # stage 1 dies: the worker's next step fails, its engine breaks, its process exits and the
        # supervisor replaces it, with a fresh rank actor on bundle 1; the pool serves again
        ranks = [p for p in cluster.processes() if command_of(p).startswith("ray::RankActor")]
        assert len(ranks) == 1, [command_of(p) for p in cluster.processes()]
        os.kill(ranks[0], signal.SIGKILL)
        t_kill = time.monotonic()
        while "worker prefill-0 replaced: " not in err.read_text():  # the supervisor's line
            assert time.monotonic() - t_kill < START_TIMEOUT_S, err.read_text()[-5000:]
            try:  # a prompt makes the broken stage's worker notice (its step fails)
                _generate(router, random_prompts([20], seed=int(time.monotonic()))[0])
            except grpc.RpcError:
                pass
            time.sleep(2)
        assert _generate(router, again) == (want_again, "prefill-0")  # in stages again
        t_back = time.monotonic() - t_kill
        state = ask_ray(cluster, address)
        rank1 = [a for a in state["actors"] if a["name"] == "prefill-0-rank1"]
        assert sorted(a["state"] for a in rank1) == ["ALIVE", "DEAD"], state["actors"]
        alive = {a["name"]: a["node"] for a in state["actors"] if a["state"] == "ALIVE"}
        assert alive["prefill-0"] != alive["prefill-0-rank1"], state["actors"]
        assert "worker prefill-0 died (" in err.read_text()

        up.send_signal(signal.SIGINT)  # Ctrl-C: stops the workers, their rank actors, the groups
        up.wait(240)
        after = ask_ray(cluster, address)
        left = [a for a in after["actors"] if a["state"] != "DEAD"]
        assert left == [], after["actors"]  # nothing of the deployment left behind
    finally:
        if up is not None and up.poll() is None:
            up.send_signal(signal.SIGUSR1)  # `up` writes every thread's stack to stderr
            time.sleep(3)
            up.kill()
            up.wait()
        cluster.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert up.returncode == 0, f"exit status {up.returncode}\n{err.read_text()[-8000:]}"
    assert cluster.processes() == []
    assert not pathlib.Path(ray_tmp).exists()
    print(
        f"ray start x2: {t_ray:.1f}s; up to served: {t_up:.1f}s; served again {t_back:.1f}s after "
        f"the stage's kill; all {time.perf_counter() - t0:.1f}s"
    )
