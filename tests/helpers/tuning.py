"""Hand-made profiles and requests for the simulator and tuner tests, `pdserve tune`'s arguments,
and the check that a YAML the tuner wrote is one `pdserve up` would launch."""

from __future__ import annotations

import pathlib

from pdserve.deploy.config.checks import fit_problems
from pdserve.deploy.config.load import load_config
from pdserve.deploy.prechecks import check_resources
from pdserve.tuning.deploy_yaml import hf_config
from pdserve.tuning.perf_model import profile_dict, profile_from_dict
from pdserve.tuning.workload import RequestSpec

# the derived GPU profile that ships with the tuner (Llama-3-8B on H100s)
DERIVED = (
    pathlib.Path(__file__).resolve().parents[2] / "tuning" / "profiles" / "h100_llama3_8b.json"
)
# the toy model's shape: 10 layers of 6 query and 3 KV heads of 64, hidden size 384
SHAPE = dict(num_layers=10, num_heads=6, num_kv_heads=3, head_dim=64, hidden_size=384)
MODEL = dict(id="Toy-1", name="toy", **SHAPE, dtype="float32")


def make_profile(
    prefill=(0.01, 0.001, 0.0),
    decode=(0.02, 0.001, 0.0),
    capacity=100_000,
    bandwidth=1e6,
    latency=0.001,
    tps=(1,),
    device="cpu",
    as_dict=False,
):
    """A hand-made profile: 10 layers, 1000 bytes of KV per token, block size 16."""
    data = profile_dict(
        model=dict(MODEL),
        kv_bytes_per_token=1000,
        hardware={"device": device, "kv_cache_memory": 1 << 28, "threads_per_rank": 1},
        tp={
            t: {
                "prefill": {"coef": list(prefill)},
                "decode": {"coef": list(decode)},
                "kv_capacity_tokens": capacity,
            }
            for t in tps
        },
        kv_transfer={"grpc": {"bandwidth_bytes_per_s": bandwidth, "latency_s": latency}},
    )
    return data if as_dict else profile_from_dict(data)


def toy_engine_profile_dict() -> dict:
    """The toy model's engine profile as the calibration tests start from it: engine step models
    only (no serving block), a bare CPU, a fast lossless link."""
    return profile_dict(
        model=dict(MODEL),
        kv_bytes_per_token=1000,
        hardware={"device": "cpu"},
        tp={
            1: {
                "prefill": {"coef": [0.01, 0.001, 0.0]},
                "decode": {"coef": [0.02, 0.001, 0.0]},
                "kv_capacity_tokens": 100_000,
            }
        },
        kv_transfer={"grpc": {"bandwidth_bytes_per_s": 1e9, "latency_s": 0.0}},
    )


def one(prompt, output, at=0.0):
    return RequestSpec(at, prompt, output)


def tune_argv(profile, workload: str, slo: str, devices, *extra: str) -> list[str]:
    """`pdserve tune`'s arguments: the four it requires, then `extra`."""
    required = ["--profile", str(profile), "--workload", workload, "--slo", slo]
    return ["tune", *required, "--devices", str(devices), *extra]


def toy_tune_argv(profile, devices, *extra: str) -> list[str]:
    """tune_argv of a short synthetic load with a loose SLO, colocated workers considered, the
    toy model named."""
    return tune_argv(
        profile,
        "synthetic:200:20",
        "ttft=2s,tpot=100ms",
        devices,
        "--colocated",
        "--model",
        "toy",
        *extra,
    )


def assert_launchable(path, profile) -> None:
    """What `pdserve up` checks before Ray starts (deploy/prechecks.preflight), on a YAML `pdserve
    tune` wrote, bar what this machine cannot stand in for: the model, which is on the machine it
    was tuned for (`up --check` here refuses it first), and the router's ports (a probe opens a
    socket: tests/integration/test_up_check_same_refusals.py). It loads, the pools fit the
    profile's model (fit_problems, the placement refusals included), and a local Ray with the
    YAML's ray.num_cpus and the devices it was tuned for holds them."""
    cfg = load_config(path)
    assert fit_problems(cfg, hf_config(profile)) == []
    if cfg.ray.address is None:
        pools = [p for _, p in cfg.worker_pools()]
        have = {
            "CPU": float(cfg.ray.num_cpus),
            "GPU": sum(p.replicas * p.tp * p.resources.num_gpus for p in pools),
        }
        check_resources(cfg, have, [have], local=True)


def bench_args(*argv: str):
    """`pdserve bench`'s parsed arguments for `argv` (tuning/bench.py add_args; the router's
    address a port nothing listens on)."""
    import argparse

    from pdserve.tuning import bench

    p = argparse.ArgumentParser()
    bench.add_args(p, "127.0.0.1:1")
    return p.parse_args(list(argv))
