"""Does a deployment's step speed drift with its age? One deployment, the same open-loop load run
N times back to back, and after each run the measured/modelled time of the engine steps it ran
(back-to-back steps only, against a profile's serving step models).

    python bench/step_repeat.py --placement disaggregated --repeats 5 \
        --profile bench/results/profile_cpu_smollm2_1thread_inload.json

The profile is the in-load one bench/slo_validation.py writes beside its serving profile.
A trend over the repeats would point at the deployment (something growing in a worker); ratios
that wander without one point at the host. Prints one line a repeat.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402

from bench import slo_validation as sv  # noqa: E402
from deploy.tuning.calibration import effective_steps, modelled_s  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--placement", choices=sv.PLACEMENTS, default="disaggregated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rate", type=float, default=3.0)
    p.add_argument("--profile", default=str(sv.RESULTS / "profile_cpu_smollm2_1thread_inload.json"))
    args = p.parse_args()
    from deploy.config import validate_config
    from deploy.launcher import up
    from deploy.tuning.perf_model import load_profile
    profile = load_profile(args.profile)
    cfg = argparse.Namespace(model="smollm2", kv_cache_memory=512 << 20, max_model_len=1024,
                             max_num_batched_tokens=512, ray_temp_dir="/tmp/pdsv_ray")
    cluster = up(validate_config(sv.deploy_dict(cfg, args.placement), args.placement), block=False)
    try:
        router = cluster.router_address
        sv.run_child(sv.bench_cmd(router, ["--prompt-len", "128", "--output-len", "16", "--rate", "4",
                                           "--num-requests", "12", "--seed", str(sv.WARMUP_SEED)]), 300)
        sv.take_step_traces(cluster)
        for k in range(args.repeats):
            t0 = time.time()
            sv.run_child(sv.bench_cmd(router, [
                "--trace", "azure_conv", "--trace-start", "60", "--scale", "0.2", "--max-prompt", "512",
                "--max-output", "64", "--num-requests", "100", "--rate", f"{args.rate:g}", "--seed", "7000"]), 600)
            parts = []
            for name, w in sv.take_step_traces(cluster).items():
                steps = effective_steps(w["steps"])
                back_to_back = [s for s, nxt in zip(steps, steps[1:]) if nxt["start"] - s["end"] < 0.002]
                r = [(s["end"] - s["start"]) / modelled_s(profile.step_model(1, w["kind"]), s)
                     for s in back_to_back]
                parts.append(f"{name}: {len(r)} steps, measured/modelled p50 {np.median(r):.3f} "
                             f"mean {np.mean(r):.3f}")
            print(f"repeat {k}: {time.time() - t0:.0f} s; " + " | ".join(parts), flush=True)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
