"""What a sleeping deployment gives back, and what sleeping costs (engine/sleep.py,
router/sleep.py): the README's example deployment (SmolLM2, one prefill and one decode worker,
the shm KV backend) with `router.sleep_mode` on.

    python -m benchmarks.cluster.sleep              # ~2 min on 2 idle cores
    python -m benchmarks.cluster.sleep --cycles 1   # smoke run

Each cycle, at each of levels 1 and 2: POST /sleep?level=N, the memory then, POST /wake_up, the
memory then, and one greedy request (128-token prompt, 32 tokens) whose TTFT and tokens are
compared with the same request before any sleep. Memory: each worker process's resident set
(VmRSS, and its anonymous and shared parts) from /proc, /dev/shm's used bytes (the decode pool
is a file there) and the machine's MemAvailable. Times: each call from request to answer at the
client. Writes benchmarks/results/sleep.json (with the CPU model and flags).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

from benchmarks import bench_common as bc
from benchmarks.chaos_harness import deployment, example_config

PROMPT_LEN, MAX_TOKENS = 128, 32


def _status_kb(pid: int) -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in ("VmRSS", "RssAnon", "RssShmem", "RssFile"):
                    out[key] = int(line.split()[1])
    except OSError:
        pass
    return out


def memory(cluster) -> dict:
    """Each worker's resident memory (MiB), /dev/shm's used MiB, the machine's MemAvailable."""
    workers = {}
    for r in cluster.replicas:
        pid = (r.info or {}).get("pid")
        if pid:
            workers[r.name] = {k: v // 1024 for k, v in _status_kb(pid).items()}
    st = os.statvfs("/dev/shm")
    with open("/proc/meminfo") as f:
        meminfo = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return {
        "workers_mib": workers,
        "workers_rss_mib": sum(w.get("VmRSS", 0) for w in workers.values()),
        "dev_shm_used_mib": (st.f_blocks - st.f_bfree) * st.f_frsize // 2**20,
        "mem_available_mib": meminfo["MemAvailable"] // 1024,
    }


def post(url: str) -> tuple[float, dict]:
    req = urllib.request.Request(url, data=b"", method="POST")
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as reply:
        body = reply.read()
    return time.perf_counter() - t, json.loads(body or b"{}")


def one_request(stub, prompt: list[int]) -> dict:
    from pdserve.protos.pdserve.v1 import pdserve_pb2 as pb

    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    sent, first, tokens = time.perf_counter(), None, []
    for resp in stub.Generate(request, timeout=300):
        if resp.HasField("delta") and resp.delta.token_ids:
            first = first if first is not None else time.perf_counter()
            tokens += list(resp.delta.token_ids)
    return {"ttft_ms": round((first - sent) * 1000, 1), "tokens": tokens}


def cycle(cluster, stub, prompt, level: int, want: list[int]) -> dict:
    url = cluster.http_url
    slept_s, answer = post(f"{url}/sleep?level={level}")
    time.sleep(0.5)  # (the workers' Stats and /proc settle)
    asleep = memory(cluster)
    woke_s, woken = post(f"{url}/wake_up")
    awake = memory(cluster)
    after = one_request(stub, prompt)
    bc.log(
        f"level {level}: sleep {slept_s:.2f} s, wake {woke_s:.2f} s; workers' RSS asleep "
        f"{asleep['workers_rss_mib']} MiB, /dev/shm {asleep['dev_shm_used_mib']} MiB; first TTFT "
        f"after {after['ttft_ms']} ms"
    )
    return {
        "level": level,
        "sleep_s": round(slept_s, 3),
        "wake_s": round(woke_s, 3),
        "sleep_answer": answer,
        "wake_answer": woken,
        "asleep": asleep,
        "awake": awake,
        "first_after_wake": {"ttft_ms": after["ttft_ms"], "same_tokens": after["tokens"] == want},
    }


def run(args) -> dict:
    import grpc

    from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc

    config = example_config()
    config["router"]["http_port"] = 0
    config["router"]["sleep_mode"] = True
    prompts = bc.random_prompts(7100, 3, PROMPT_LEN)
    with deployment(config) as (cluster, _):
        with grpc.insecure_channel(cluster.router_address) as channel:
            stub = pdserve_pb2_grpc.PDServeStub(channel)
            one_request(stub, prompts[0])  # the first request's own costs (first_request.py)
            warm = [one_request(stub, p) for p in prompts]  # fresh prompts: no prefix hit
            want = one_request(stub, prompts[0])["tokens"]
            awake = memory(cluster)
            cycles = [
                cycle(cluster, stub, prompts[0], level, want)
                for _ in range(args.cycles)
                for level in (1, 2)
            ]
    return {
        "deployment": "deploy/examples/local-cpu.yaml, router.sleep_mode: true",
        "awake_before": awake,
        "warm_ttft_ms": [w["ttft_ms"] for w in warm[1:]],
        "cycles": cycles,
    }


def main(argv=None) -> int:
    ap = bc.script_parser(__doc__)
    ap.add_argument("--cycles", type=int, default=3, help="sleep/wake cycles per level")
    bc.add_out_arg(ap, "sleep.json")
    args = ap.parse_args(argv)
    return bc.run_and_write("benchmarks.cluster.sleep", argv, args.out, lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
