"""Part s of the chaos benchmark (benchmarks/robustness/chaos.py): the shm KV backend's pools across decode
worker deaths.

With `kvtransfer.backend: shm`, a decode worker's KV pool is a file under /dev/shm that the
prefill worker maps and writes into. A decode worker killed with kill -9 cannot unlink its file,
and the prefill worker still maps it. One prefill and one decode worker on the embedded SmolLM2;
the decode worker is killed --kills times (5), each time after streams went through it, and the
supervisor replaces it. Counted before the first kill and after each replacement: the pool files
under /dev/shm and their bytes, /dev/shm's used bytes, and the distinct pool files the prefill
worker maps (/proc/PID/maps). The must-show: all back to their start after the last kill.

  python -m benchmarks.robustness.chaos --parts s
"""

from __future__ import annotations

import glob
import os
import signal
import time

from benchmarks.bench_common import log, random_prompts
from benchmarks.chaos_harness import (
    Child,
    deployment,
    example_config,
    jobs_for,
    run_streams,
    wait_kv_free,
    wait_replaced,
)

SHM = "/dev/shm"
UNMAP_WAIT_S = 5.0  # the shm sender checks its peers' pool files every 2 s


def shm_state(prefill_pid: int) -> dict:
    files = glob.glob(os.path.join(SHM, "pdserve-kv-*"))
    sizes = []
    for path in files:
        try:
            sizes.append(os.path.getsize(path))
        except FileNotFoundError:
            pass
    with open(f"/proc/{prefill_pid}/maps") as f:
        mapped = {line.split()[-1] for line in f if "pdserve-kv-" in line}
    st = os.statvfs(SHM)
    return {
        "pool_files": len(sizes),
        "pool_file_bytes": sum(sizes),
        "shm_used_bytes": (st.f_blocks - st.f_bfree) * st.f_frsize,
        "prefill_maps": len(mapped),
        "prefill_maps_deleted": sum(m.endswith("(deleted)") or "(deleted)" in m for m in mapped),
    }


def part_s(args) -> dict:
    """kill -9 of the decode worker, `args.kills` times, with the shm backend."""
    import ray

    from pdserve.deploy.launcher import RestartPolicy

    config = example_config(prefill=1, decode=1, prefix_caching=False)
    config["kvtransfer"] = {"backend": "shm"}
    jobs = jobs_for(random_prompts(7100, 16, 48), 8)
    out = {"kills": args.kills, "states": []}
    # kills seconds apart would read as a crash loop, which the supervisor gives up on after
    # three: here every kill counts as a death after stable serving
    policy = RestartPolicy(poll_s=0.5, stable_s=1.0)
    with deployment(config, restart=policy) as (cluster, _):
        address = cluster.router_address
        prefill = next(r for r in cluster.replicas if r.role == "prefill")
        victim = next(r for r in cluster.replicas if r.role == "decode")
        prefill_pid = ray.get(prefill.actor.pid.remote(), timeout=30)
        errors = []

        def streams_and_state(label: str) -> dict:
            rows = Child(run_streams, address, jobs, 8).result()
            errors.extend(r["error"] for r in rows if r["error"])
            time.sleep(UNMAP_WAIT_S)
            state = {"after": label, **shm_state(prefill_pid)}
            out["states"].append(state)
            log(f"s: {label}: {state}")
            return state

        start = streams_and_state("start")
        for k in range(args.kills):
            old_actor = victim.actor
            os.kill(ray.get(old_actor.pid.remote(), timeout=30), signal.SIGKILL)
            t0 = time.perf_counter()
            wait_replaced(cluster, victim, old_actor, "decode", 1)
            log(f"s: kill {k + 1}: replaced in {time.perf_counter() - t0:.1f} s")
            streams_and_state(f"kill {k + 1}")
        end = out["states"][-1]
        free, _, _ = wait_kv_free(cluster)
    keys = ("pool_files", "pool_file_bytes", "prefill_maps")
    out.update(
        stream_errors=len(errors),
        first_errors=errors[:3],
        back_to_start={k: end[k] == start[k] for k in keys},
        shm_used_growth_bytes=end["shm_used_bytes"] - start["shm_used_bytes"],
        kv_all_free=free,
    )
    return out


def add_args(p) -> None:
    p.add_argument("--kills", type=int, default=5, help="part s: kill -9s of the decode worker")
