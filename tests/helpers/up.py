"""`pdserve up` as a child process, for the e2e tests that serve through it (tests/e2e/test_hub_up.py,
tests/e2e/test_moe_up.py, test_hybrid_up.py): start it with a small YAML, read the router's gRPC
address from its stdout, stream greedy tokens from the router, stop it with SIGTERM as Ctrl-C
would; `serves_as_the_engine` runs a random model of an architecture kind both ways;
`ray_temp_dir` gives a local Ray's temp dir and removes it afterwards.

Not a test module: imported as `from helpers.up import ...` (pytest puts tests/ on sys.path).
benchmarks/chaos_harness.py has its own copy of the start and stop (benchmarks do not import tests/).
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import yaml

ROOT = pathlib.Path(__file__).parents[2]
START_TIMEOUT_S = 300.0


@contextlib.contextmanager
def ray_temp_dir():
    """Yields a fresh temp dir for a local Ray, short (prefix "pdray" in the system's temp dir:
    Ray's Unix socket paths live under it, and those have a length limit), and removes it on the
    way out, also when the test failed (each left behind holds up to ~9 MB of Ray's logs). Leave
    it only after the Ray it served stopped: a Ray still running writes into it."""
    path = tempfile.mkdtemp(prefix="pdray")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def small_pools_yaml(path: pathlib.Path, kv_cache_memory: int, ray_tmp: str, **top) -> pathlib.Path:
    """A deployment YAML for a 2-core machine: prefill and decode pools of 1 replica on 1 CPU and 1
    thread each, `kv_cache_memory` bytes of KV each, a local Ray of 2 CPUs under `ray_tmp` (a
    `ray_temp_dir`, removed once that Ray stopped); `top`: more top-level keys (`model`, ...)."""
    pool = {"replicas": 1, "resources": {"num_cpus": 1}, "num_threads": 1,
            "kv_cache_memory": kv_cache_memory}  # fmt: skip
    data = {**top, "pools": {"prefill": pool, "decode": pool},
            "ray": {"num_cpus": 2, "temp_dir": ray_tmp}}  # fmt: skip
    path.write_text(yaml.safe_dump(data))
    return path


def router_address(proc: subprocess.Popen, timeout_s: float) -> str:
    """Reads `proc`'s stdout on a thread of its own until `ready`; the router's address it printed."""
    seen, address = threading.Event(), []

    def read():
        for line in proc.stdout:
            found = re.fullmatch(r"router on (\S+)", line.strip())
            if found:
                address.append(found[1])
            if line.strip() == "ready":
                seen.set()
                return

    threading.Thread(target=read, daemon=True).start()
    if not seen.wait(timeout_s):
        state = f"exited {proc.poll()}" if proc.poll() is not None else "still starting"
        raise AssertionError(f"`pdserve up` printed no 'ready' within {timeout_s:.0f}s ({state})")
    return address[0]


def stop_up(proc: subprocess.Popen) -> None:
    """SIGTERM (`up` stops its deployment and its local Ray); a kill after 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def pdserve_up(args: list[str], err_path: pathlib.Path, env: dict | None = None):
    """Runs `python -m pdserve up ARGS` from the repository root and yields the router's address
    once it printed `ready`; stops it on the way out, printing the tail of its stderr (kept in
    `err_path`) when it failed."""
    with open(err_path, "w") as err:
        up = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "up", *args],
            stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, env=env,
        )  # fmt: skip
    try:
        yield router_address(up, START_TIMEOUT_S)
    finally:
        stop_up(up)
        if up.returncode not in (0, None):
            print(err_path.read_text()[-4000:])


def greedy_tokens(stub, pb, ids: list[int], max_tokens: int, model: str = "", metadata=()):
    """The token ids one greedy Generate stream (ignore_eos) returns for the prompt `ids`."""
    request = pb.GenerateRequest(
        model=model,
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    tokens = []
    for resp in stub.Generate(request, metadata=metadata, timeout=120):
        if resp.HasField("delta"):
            tokens += list(resp.delta.token_ids)
    return tokens


def flags_config(tmp_path, yaml_data: dict | None, *flags: str):
    """The DeployConfig `pdserve up [YAML] FLAGS` would start (None: no YAML), without starting
    it (the unit tests of `up`'s flags)."""
    import argparse

    from pdserve.up_flags import add_up_flags, up_config

    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?")
    add_up_flags(parser)
    argv = list(flags)
    if yaml_data is not None:
        path = tmp_path / "deploy.yaml"
        path.write_text(yaml.safe_dump(yaml_data))
        argv.insert(0, str(path))
    return up_config(parser.parse_args(argv))[0]


def serves_as_the_engine(tmp_path: pathlib.Path, kind: str, kv_bytes: int) -> None:
    """A random model of `kind` (tests/helpers/arch.py) served by `pdserve up --model DIR` with
    one prefill and one decode worker: 4 prompts of mixed lengths, sent at once over gRPC, get
    the same 16 greedy tokens as `LLM(DIR, dtype="float32")` in this process, and those differ
    from prompt to prompt (a real check)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from helpers.arch import build_arch_model
    from helpers.models import random_prompts
    from pdserve.engine import LLM, SamplingParams
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    new, max_len = 16, 256
    model_dir = tmp_path / kind
    build_arch_model(model_dir, kind, initializer_range=0.1)
    prompts = random_prompts((3, 17, 40, 90), seed=29)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=kv_bytes, max_model_len=max_len)
    greedy = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    llm.shutdown()
    assert len({tuple(w) for w in want}) == len(want)
    with ray_temp_dir() as ray_tmp:
        config = small_pools_yaml(tmp_path / "small.yaml", kv_bytes, ray_tmp)
        args = [str(config), "--model", str(model_dir), "--prefill-replicas", "1",
                "--decode-replicas", "1", "--port", "0", "--http-port", "off",
                "--max-model-len", str(max_len), "--dtype", "float32"]  # fmt: skip
        with pdserve_up(args, tmp_path / "up.err") as address:
            with grpc.insecure_channel(address) as channel:
                stub = pdserve_pb2_grpc.PDServeStub(channel)
                with ThreadPoolExecutor(len(prompts)) as pool:  # at once: mixed lengths, one batch
                    got = list(pool.map(lambda ids: greedy_tokens(stub, pb, ids, new), prompts))
    assert got == want
