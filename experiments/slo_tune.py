"""The tuner runs of experiments/slo_validation.py: `pdserve tune --devices 2 --colocated` in a child
process on a profile and the measured trace slice (or the whole trace), its pick and ranking
parsed from what it prints."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

from experiments.slo_measure import REPO_ROOT, length_args, log
from experiments.slo_simulate import WORKLOAD_SEEDS
from pdserve.tuning import workload


def slice_csv(args, wl: str) -> pathlib.Path:
    """The measured slice of the trace (its first --num-requests rows, unscaled) as a trace file,
    so the tuner sees exactly the requests that were measured."""
    path = args.out.with_name(f"slo_validation_{wl}_slice.csv")
    src = workload.resolve_trace(wl)
    with open(src) as f:
        lines = f.read().splitlines()
    path.write_text("\n".join(lines[: 1 + args.num_requests]) + "\n")
    return path


def run_tuner(args, wl: str, profile_path, trace: str) -> dict:
    slo = args.slo_text + ",attainment=0.9"
    tag = f"{pathlib.Path(profile_path).stem}_{'slice' if trace != wl else 'full'}"
    plot = args.out.parent / f"slo_validation_tune_{wl}_{tag}.png"
    cmd = [
        sys.executable,
        "-m",
        "pdserve",
        "tune",
        "--profile",
        str(profile_path),
        "--workload",
        trace,
        *length_args(args, wl),
        "--slo",
        slo,
        "--devices",
        "2",
        "--colocated",
        "--tp",
        "1",
        "--backend",
        "grpc",
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--seed",
        str(WORKLOAD_SEEDS[wl]),
        "--plot",
        str(plot),
    ]
    log("$ " + " ".join(cmd))
    p = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    m = re.search(r"^best: (.+?): ([0-9.e+-]+) req/s", p.stdout, re.M)
    ranking = re.findall(
        r"^\s+\d+\s+(.+?)\s{2,}\d+\s+([0-9.e+-]+)\s+([0-9.e+-]+|-)", p.stdout, re.M
    )
    return {
        "command": " ".join(
            ["pdserve"]
            + [
                str(pathlib.Path(c).relative_to(REPO_ROOT))
                if str(c).startswith(str(REPO_ROOT))
                else c
                for c in cmd[3:]
            ]
        ),
        "profile": str(profile_path),
        "workload": trace,
        "rc": p.returncode,
        "stdout": out,
        "best": m.group(1) if m else None,
        "best_goodput": float(m.group(2)) if m else None,
        "ranking": [
            {
                "placement": a.strip(),
                "estimate": float(b),
                "simulated": None if c == "-" else float(c),
            }
            for a, b, c in ranking
        ],
        "plot": plot.name,
    }
