"""`pdserve up --address` against a Ray cluster made as an operator makes one: `ray start --head`
with token authentication and a second `ray start` node with a custom resource (`node2`), both on
this machine standing in for two hosts, one CPU each, each with its own ports, in a temp dir of this
module. The two tests share the cluster (starting one costs 10-20 s of CI) and run one after the
other, each with a `pdserve up` of its own that exits before the next starts.

- Joining (issue #28, must-show a): `pdserve up` runs as a command with RAY_AUTH_MODE unset and the
  token only where Ray's clients look for it (RAY_AUTH_TOKEN_PATH); its decode pool is pinned to
  the second node by the custom resource. Greedy tokens through its router equal the engine's
  alone, its console shows each worker's start stages and the start table, and Ray's actor table
  has the decode actor, named decode-0, on the second node (read from the GCS: `ray list actors`
  and ray.util.state need the dashboard, which the `ray` this project installs has no packages
  for). Without a token, `up` fails at once in one line that says what to set.
- Pipeline stages on two nodes (issue #53, must-show d's second half): the prefill pool is PP 2
  with 0.6 CPU per rank, so no node holds both of a worker's stages and Ray's PACK strategy spreads
  them (deploy/placement.py); rank 1 runs as a Ray actor on its own bundle (deploy/rank_actors.py).
  Ray's actor table has prefill-0 (stage 0) and prefill-0-rank1 (stage 1) on different nodes, the
  start table names both, greedy tokens through the router equal the engine's PP=1 tokens in one
  process. Then stage 1's process is killed: the worker's engine breaks, the worker exits and is
  replaced with a fresh rank actor, and the same tokens are served again. After Ctrl-C no actor of
  the deployment is alive and `up` exited 0.

Each `ray start` runs in a session of its own; the module kills only the processes of those
sessions (RayNodes), never with `ray stop` (which would end every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

import grpc
import pytest
import yaml

from helpers.models import make_tiny_model, random_prompts
from helpers.process import command_of
from helpers.ray_nodes import RayNodes, ask_ray, free_ports, read_until_table, up_command
from helpers.up import ray_temp_dir

pytestmark = [
    pytest.mark.slow,
    # its `ray start` nodes need the machine to themselves: two such clusters starting at once
    # overran Ray's node registration wait (a run with four test processes), and on the slower
    # AVX2 EPYC the head alone timed out in both full suites there ("The current node timed
    # out during startup", load average above 6), where alone the two starts take 16 s
    pytest.mark.serial,
    pytest.mark.skipif(sys.platform != "linux", reason="finds its Ray processes in /proc"),
]

MAX_TOKENS = 16
KV_BYTES = 4 << 20
START_TIMEOUT_S = 240.0


@dataclass
class TwoNodes:
    cluster: RayNodes
    address: str  # the head's GCS address
    token: pathlib.Path  # the cluster's token file
    ray_tmp: str  # the cluster's temp dir: its logs, the workers' log files


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """The head (one CPU) and a second node (one CPU and the resource `node2`), token-authenticated;
    at the end every process of theirs is killed and their temp dir removed."""
    t0 = time.perf_counter()
    token = tmp_path_factory.mktemp("ray-token") / "ray_token"
    token.write_text(uuid.uuid4().hex)
    with ray_temp_dir() as ray_tmp:  # removed after the kill below, which stops its writers
        cluster = RayNodes(ray_tmp, token)
        try:
            head_port, client_port = free_ports(2)
            head_args = ["--head", "--port", str(head_port), "--temp-dir", ray_tmp]
            head_args += ["--include-dashboard", "false"]
            head_args += ["--ray-client-server-port", str(client_port)]
            cluster.start(*head_args)
            address = f"127.0.0.1:{head_port}"
            cluster.start("--address", address, "--resources", json.dumps({"node2": 1}))
            print(f"ray start x2: {time.perf_counter() - t0:.1f}s")
            yield TwoNodes(cluster, address, token, ray_tmp)
        finally:
            cluster.kill()
    assert cluster.processes() == []
    assert not pathlib.Path(ray_tmp).exists()


def operator_env() -> dict:
    """An operator's shell: no RAY_AUTH_MODE, no token."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}


def stop_up(up: subprocess.Popen | None) -> str:
    """Ctrl-C to a `pdserve up` still running, then a wait for its exit (stopping took over 60 s
    on a loaded machine); past 240 s its threads' stacks go to its stderr and it is killed. Says
    how it ended, for the assertion on its exit status."""
    if up is None or up.poll() is not None:
        return "exited before the test stopped it"
    up.send_signal(signal.SIGINT)  # Ctrl-C: stops its actors and leaves the cluster
    t_stop = time.perf_counter()
    try:
        up.wait(240)
        return f"exited {time.perf_counter() - t_stop:.1f}s after SIGINT"
    except subprocess.TimeoutExpired:
        up.send_signal(signal.SIGUSR1)  # `up` writes every thread's stack to stderr
        time.sleep(3)
        up.kill()
        up.wait()
        return "still running 240s after SIGINT; its threads' stacks are in its stderr; killed"


def write_config(path: pathlib.Path, model_dir: str, **pools: dict) -> pathlib.Path:
    """A deployment YAML of `pools` in float32, its router on a free loopback port."""
    router = {"host": "127.0.0.1", "port": 0, "http_port": None}
    config = {"model": model_dir, "dtype": "float32", "pools": pools, "router": router}
    path.write_text(yaml.safe_dump(config))
    return path


def _engine_tokens(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    """The engine's greedy tokens in this process (one stage, float32)."""
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


def test_up_joins_a_token_cluster_and_pins_decode_to_the_second_node(
    two_nodes, tiny_models, tmp_path
):
    t0 = time.perf_counter()
    model_dir, _ = tiny_models("llama-gqa")
    prompt_ids = random_prompts([23], seed=5)[0]
    [want] = _engine_tokens(model_dir, [prompt_ids])
    assert len(want) == MAX_TOKENS

    address, ray_tmp = two_nodes.address, two_nodes.ray_tmp
    pool = {"replicas": 1, "tp": 1, "kv_cache_memory": KV_BYTES}
    config = write_config(
        tmp_path / "two-nodes.yaml",
        model_dir,
        prefill={**pool, "resources": {"num_cpus": 1}},
        decode={**pool, "resources": {"num_cpus": 1, "node2": 1}},
    )
    env = operator_env()
    up, stop = None, ""
    try:
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
        up = up_command(config, address, {**env, "RAY_AUTH_TOKEN_PATH": str(two_nodes.token)}, err)
        out = read_until_table(up, START_TIMEOUT_S)
        assert "ready" in out, f"{out}\n{err.read_text()[-3000:]}"
        t_up = time.perf_counter() - t0
        router = next(x.split()[-1] for x in out if x.startswith("router on "))
        assert _generate(router, prompt_ids)[0] == want

        state = ask_ray(two_nodes.cluster, address)
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
        stop = stop_up(up)
    assert up.returncode == 0, f"exit status {up.returncode}, {stop}\n{err.read_text()[-8000:]}"
    # nothing of the deployment is left on the cluster the next test uses
    left = [a for a in ask_ray(two_nodes.cluster, address)["actors"] if a["state"] != "DEAD"]
    assert left == [], left
    print(f"up to served: {t_up:.1f}s; all {time.perf_counter() - t0:.1f}s")


def test_a_pp2_prefill_pool_spans_two_ray_nodes_and_serves_the_pp1_tokens(two_nodes, tmp_path):
    t0 = time.perf_counter()
    model_dir = str(tmp_path / "tiny4")
    make_tiny_model(model_dir, "llama-gqa", seed=7, num_hidden_layers=4)
    # a fresh prompt each time: one the decode worker holds could be prefilled there instead
    # (router.local_prefill), and these must go through the prefill worker's stages
    prompt_ids, again = random_prompts([29, 31], seed=53)
    want, want_again = _engine_tokens(model_dir, [prompt_ids, again])  # PP 1, one process
    assert len(want) == MAX_TOKENS

    address, cluster = two_nodes.address, two_nodes.cluster
    small = {"replicas": 1, "num_threads": 1, "kv_cache_memory": KV_BYTES}
    config = write_config(
        tmp_path / "pp-two-nodes.yaml",
        model_dir,
        # 2 x 0.6 CPU: more than one node's 1 CPU, so the stages go to two nodes
        prefill={**small, "pp": 2, "resources": {"num_cpus": 0.6}},
        decode={**small, "resources": {"num_cpus": 0.4}},
    )
    env = {**operator_env(), "RAY_AUTH_TOKEN_PATH": str(two_nodes.token)}
    up, stop = None, ""
    err = tmp_path / "up.err"
    try:
        up = up_command(config, address, env, err)
        out = read_until_table(up, START_TIMEOUT_S)
        assert "ready" in out, f"{out}\n{err.read_text()[-5000:]}"
        t_up = time.perf_counter() - t0
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
    finally:
        stop = stop_up(up)
    assert up.returncode == 0, f"exit status {up.returncode}, {stop}\n{err.read_text()[-8000:]}"
    after = ask_ray(cluster, address)
    left = [a for a in after["actors"] if a["state"] != "DEAD"]
    assert left == [], after["actors"]  # nothing of the deployment left behind
    print(
        f"up to served: {t_up:.1f}s; served again {t_back:.1f}s after the stage's kill; "
        f"all {time.perf_counter() - t0:.1f}s"
    )
