"""The served side of benchmarks/moe_decode.py: the MoE model behind `pdserve up --model DIR`.

`run_served(model_dir, prompts, new)` starts `pdserve up --model DIR --prefill-replicas 1
--decode-replicas 1 --port 0 --http-port off --dtype float32 --max-model-len P+M` as a child
process, with a small YAML for what has no flag (`served_yaml`: each pool's `num_threads`,
`resources: {num_cpus: 1}` and `kv_cache_memory`, sized for N sequences of P + M tokens plus a
block each; `ray: {num_cpus: 2, temp_dir: <short tmp>}`). It reads the router's gRPC address from
the child's stdout ("router on ADDR", then "ready"), warms the deployment with two short requests,
then sends the N prompts (token ids) at once, one thread and one `Generate` stream each (greedy,
max_tokens M, ignore_eos), timestamping every streamed delta, and stops the child with SIGTERM
(`up` stops its workers and its local Ray).

Decode tok/s, as close to the engine side's measure as a client gets: t_all = the moment the last
request received its first token (every request then has one); decode tok/s = the tokens received
after t_all / (the last token's arrival - t_all). The engine's figure counts steps in one process;
this one adds the router, the prefill->decode KV handoff, gRPC streaming and the client's threads
(all on the same 2 cores), so it is a served figure, not the engine's.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.bench_common import REPO_ROOT, SEED_WARMUP, TreeCpuMonitor, log

START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0


def kv_bytes(model_keys: dict, tokens: int, dtype_bytes: int = 4) -> int:
    """KV-cache bytes for `tokens` tokens of a model with these config keys."""
    head_dim = model_keys.get("head_dim") or (
        model_keys["hidden_size"] // model_keys["num_attention_heads"]
    )
    per_token = 2 * model_keys["num_hidden_layers"] * model_keys["num_key_value_heads"] * head_dim
    return per_token * dtype_bytes * tokens


def served_yaml(kv_cache_memory: int, threads: int, ray_tmp: str) -> dict:
    """The deployment YAML's keys that have no `pdserve up` flag (the model goes by --model)."""
    pool = {
        "resources": {"num_cpus": 1},
        "num_threads": threads,
        "kv_cache_memory": kv_cache_memory,
    }
    return {
        "pools": {"prefill": dict(pool), "decode": dict(pool)},
        "ray": {"num_cpus": 2, "temp_dir": ray_tmp},
    }


def popen_up(command: list[str], err) -> subprocess.Popen:
    """`pdserve up` as a child of this checkout, stdout piped (its start table and "ready"),
    stderr to the open file `err`, no API key inherited from the caller's environment."""
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO_ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_API_KEY")},
    )  # fmt: skip


def router_address(proc: subprocess.Popen, timeout_s: float) -> str:
    """Reads `proc`'s stdout on a thread of its own until `ready`; the router address it printed.
    The thread keeps draining stdout afterwards (the start table), so the child never blocks."""
    seen, address = threading.Event(), []

    def read():
        for line in proc.stdout:
            found = re.fullmatch(r"router on (\S+)", line.strip())
            if found:
                address.append(found[1])
            if line.strip() == "ready":
                seen.set()
        seen.set()  # stdout closed: the child exited

    threading.Thread(target=read, daemon=True).start()
    seen.wait(timeout_s)
    if not address or proc.poll() is not None:
        state = f"exited {proc.poll()}" if proc.poll() is not None else "still starting"
        raise RuntimeError(f"`pdserve up` printed no 'ready' within {timeout_s:.0f}s ({state})")
    return address[0]


def stop_up(proc: subprocess.Popen) -> int | None:
    """SIGTERM (`up` stops its deployment and its local Ray), then a kill past STOP_TIMEOUT_S."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def stream(stub, pb, ids: list[int], new: int, start: threading.Barrier | None = None):
    """One greedy Generate stream: [(arrival time, token ids)] per delta."""
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True),
    )
    if start is not None:
        start.wait()
    deltas = []
    for resp in stub.Generate(request, timeout=600):
        if resp.HasField("delta"):
            deltas.append((time.perf_counter(), list(resp.delta.token_ids)))
    return deltas


def decode_rate(deltas: list[list[tuple[float, list[int]]]], t_start: float) -> dict:
    """The client's decode measure (the module's docstring) over every request's deltas."""
    t_all = max(d[0][0] for d in deltas)
    t_last = max(d[-1][0] for d in deltas)
    after = sum(len(toks) for d in deltas for t, toks in d if t > t_all)
    return {
        "t_all_first_token_s": t_all - t_start,
        "t_total_s": t_last - t_start,
        "ttft_s": sorted(d[0][0] - t_start for d in deltas),
        "decode_tokens": after,
        "decode_time_s": t_last - t_all,
        "decode_tok_s": after / (t_last - t_all) if t_last > t_all else None,
    }


def run_served(
    model_dir: str, model_keys: dict, prompts: list[list[int]], new: int, threads: int = 1
) -> dict:
    import grpc
    import yaml

    from benchmarks.moe_decode import vocab_prompts
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc

    n, p = len(prompts), max(len(x) for x in prompts)
    block = 16
    tokens = n * (-(-(p + new) // block) + 1) * block  # each sequence's blocks, plus one
    kv = kv_bytes(model_keys, tokens)
    ray_tmp = tempfile.mkdtemp(prefix="pdray")  # short: Ray's socket paths live under it
    work = tempfile.mkdtemp(prefix="moe-served-")
    config = served_yaml(kv, threads, ray_tmp)
    config_path = os.path.join(work, "served.yaml")
    with open(config_path, "w") as f:
        yaml.safe_dump(config, f)
    command = [
        sys.executable, "-m", "pdserve", "up", config_path, "--model", model_dir,
        "--prefill-replicas", "1", "--decode-replicas", "1", "--port", "0",
        "--http-port", "off", "--dtype", "float32", "--max-model-len", str(p + new),
    ]  # fmt: skip
    settings = {
        "command": " ".join(["pdserve", *command[3:]]),
        "yaml": config,
        "kv_cache_tokens_per_pool": tokens,
        "worker_threads": threads,
        "note": "prefill and decode workers: 1 reserved core and `worker_threads` torch threads "
        "each; the router runs in the `pdserve up` process, the client threads in this one",
    }
    err_path = os.path.join(work, "up.err")
    t0 = time.perf_counter()
    with open(err_path, "w") as err:
        up = popen_up(command, err)
    try:
        address = router_address(up, START_TIMEOUT_S)
        start_s = time.perf_counter() - t0
        log(f"served: `pdserve up` ready on {address} after {start_s:.0f} s")
        with grpc.insecure_channel(address) as channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            for ids in vocab_prompts(SEED_WARMUP, 2, 16):  # warm-up, as the engine side's
                stream(stub, pb, ids, 4)
            barrier = threading.Barrier(n + 1)
            results: list = [None] * n

            def client(i: int) -> None:
                try:
                    results[i] = stream(stub, pb, prompts[i], new, barrier)
                except Exception as e:  # noqa: BLE001 - reported below
                    results[i] = e

            workers = [threading.Thread(target=client, args=(i,)) for i in range(n)]
            for w in workers:
                w.start()
            mon = TreeCpuMonitor()
            barrier.wait()
            t_start = time.perf_counter()
            for w in workers:
                w.join()
            cpu = mon.stop()
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            raise RuntimeError(f"{len(failed)}/{n} served requests failed: {failed[0]!r}")
        out = {
            "settings": settings,
            "start_s": start_s,
            **decode_rate(results, t_start),
            "deltas_per_request": [len(r) for r in results],
            "cpu": cpu,
            "output_token_ids": [[t for _, toks in r for t in toks] for r in results],
        }
        out["e2e_tok_s"] = sum(len(x) for x in out["output_token_ids"]) / out["t_total_s"]
        return out
    except BaseException:
        stop_up(up)
        with open(err_path) as f:
            log(f"served: `pdserve up` stderr (tail):\n{f.read()[-4000:]}")
        raise
    finally:
        stop_up(up)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
