"""Experiment: the disaggregated pair (1 prefill + 1 decode worker, 1 torch thread each, grpc KV,
SmolLM2) on the 2-core machine, with the worker processes free to run on both cores ("unpinned")
or pinned (every thread of the prefill process on cpu 0, of the decode process on cpu 1, with
taskset). One deployment; then for each tag given, in order, a `pdserve bench` sweep of the first
120 azure_conv requests (scale 0.2, prompts <= 512, outputs <= 64) at 1.5 and 3 req/s, with the
SLO of bench/slo_validation.py (TTFT 1.5 s, TPOT 100 ms).

    python bench/pin_experiment.py unpinned,pinned,unpinned,pinned

Prints each sweep's table. The launcher itself now pins local workers (deploy.launcher.core_plan);
the "unpinned" sweeps here undo that with taskset.
"""
import glob
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = {"model": "smollm2", "router": {"host": "127.0.0.1", "port": 0, "max_inflight": 1024},
          "ray": {"address": None, "num_cpus": 2, "temp_dir": "/tmp/pdpin_ray"},
          "kvtransfer": {"backend": "grpc"},
          "pools": {r: {"replicas": 1, "tp": 1, "resources": {"num_cpus": 1}, "num_threads": 1,
                        "kv_cache_memory": 512 << 20, "max_model_len": 1024, "max_num_batched_tokens": 512}
                    for r in ("prefill", "decode")}}


def bench(router: str, extra: list[str]) -> str:
    cmd = [sys.executable, "-m", "deploy.cli", "bench", "--router", router, *extra]
    return subprocess.run(cmd, capture_output=True, text=True).stdout


def worker_pids() -> list[int]:
    pids = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            if b"WorkerActor" in open(path, "rb").read():
                pids.append(int(path.split("/")[2]))
        except OSError:
            continue
    return pids


def listening_pid(port: int, pids: list[int]) -> int:
    """Which of `pids` listens on TCP `port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            parts = line.split()
            if int(parts[1].rsplit(":", 1)[1], 16) == port and parts[3] == "0A":
                inodes.add(parts[9])
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return pid
    raise RuntimeError(f"no worker process listens on port {port}")


def main() -> int:
    sys.path.insert(0, REPO_ROOT)
    os.environ["PDSERVE_NO_PROGRESS"] = "1"
    from deploy.config import validate_config
    from deploy.launcher import up
    tags = (sys.argv[1] if len(sys.argv) > 1 else "unpinned,pinned").split(",")
    cluster = up(validate_config(CONFIG, "<pin_experiment>"), block=False)
    try:
        router = cluster.router_address
        bench(router, ["--prompt-len", "128", "--output-len", "16", "--rate", "4", "--num-requests", "12",
                       "--seed", "1000"])   # warm-up
        prefill = listening_pid(int(cluster.addresses("prefill")[0].rsplit(":", 1)[1]), worker_pids())
        for tag in tags:
            for pid in worker_pids():
                cpus = ("0" if pid == prefill else "1") if tag == "pinned" else "0,1"
                subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(pid)], capture_output=True, check=True)
            out = bench(router, ["--trace", "azure_conv", "--scale", "0.2", "--max-prompt", "512",
                                 "--max-output", "64", "--num-requests", "120", "--seed", "0",
                                 "--sweep-rates", "1.5,3", "--slo", "ttft=1.5s,tpot=100ms",
                                 "--out", f"/tmp/pin_experiment_{tag}.json"])
            print(f"== {tag}\n{out}", flush=True)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
