"""`pdserve tune` on hand-made and derived profiles: the deploy YAML it writes (which `pdserve up`
accepts), the derived GPU profile, the placements left out because the launcher refuses them,
and the argument and profile errors."""

from __future__ import annotations

import json
import re

import pytest

from helpers.tuning import DERIVED, assert_launchable, make_profile, toy_tune_argv, tune_argv
from pdserve import cli
from pdserve.deploy.config.checks import fit_problems
from pdserve.deploy.config.load import load_config, validate_config
from pdserve.tuning.deploy_yaml import deploy_yaml, hf_config
from pdserve.tuning.perf_model import ProfileError, load_profile, profile_from_dict
from pdserve.tuning.simulator import Placement, PoolSpec
from pdserve.tuning.tuner import Candidate


# ---- YAML ---------------------------------------------------------------------------------------
def test_yaml_of_either_shape_validates():
    prof = make_profile(tps=(1, 3))
    disagg = deploy_yaml(Candidate(Placement(PoolSpec(2, 3), PoolSpec(1))), prof, "smollm2", "grpc")
    cfg = validate_config(disagg)
    assert (cfg.pools.prefill.replicas, cfg.pools.prefill.tp, cfg.pools.decode.replicas) == (
        2,
        3,
        1,
    )
    assert cfg.kvtransfer.backend == "grpc" and cfg.pools.prefill.kv_cache_memory == 1 << 28
    colocated = deploy_yaml(Candidate(Placement(None, PoolSpec(4))), prof, "smollm2", "grpc")
    assert validate_config(colocated).pools.colocated.replicas == 4


def test_tune_writes_a_yaml_that_load_config_accepts(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps(make_profile(prefill=(0.01, 1e-3, 0.0), decode=(0.02, 1e-3, 0.0), as_dict=True))
    )
    out, png = tmp_path / "best.yaml", tmp_path / "c.png"
    rc = cli.main(toy_tune_argv(path, 4, "--out", str(out), "--plot", str(png)))
    text = capsys.readouterr().out
    assert rc == 0, text
    cfg = load_config(out)
    best = text.split("best: ", 1)[1].split(":", 1)[0]
    if best.startswith("colocated"):
        assert best == f"colocated {cfg.pools.colocated.replicas}x tp{cfg.pools.colocated.tp}"
    else:
        p, d = cfg.pools.prefill, cfg.pools.decode
        assert best == f"{p.replicas}P tp{p.tp} + {d.replicas}D tp{d.tp}"
    assert cfg.model == "toy" and png.stat().st_size > 10_000
    assert_launchable(out, load_profile(path))
    assert (cfg.router.host, cfg.router.port, cfg.ray.address) == ("127.0.0.1", 50051, None)
    pools = [cfg.pools.colocated] if cfg.pools.colocated else [cfg.pools.prefill, cfg.pools.decode]
    assert cfg.ray.num_cpus == sum(p.replicas * p.tp * p.resources.num_cpus for p in pools)


# ---- the derived GPU profile ---------------------------------------------------------------------
def test_derived_profile_is_marked_and_shaped_like_a_measured_one():
    data = json.loads(DERIVED.read_text())
    assert data["derived"] is True and data["source"]["publications"]
    prof = profile_from_dict(data)
    assert (prof.num_layers, prof.num_heads, prof.num_kv_heads) == (32, 32, 8)
    assert prof.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 and prof.device == "gpu"
    measured_keys = set(make_profile(as_dict=True)) | {"derived", "source"}
    assert set(data) == measured_keys
    for entry in data["tp"].values():
        assert (
            entry["prefill"]["samples"] and entry["decode"]["samples"] and "fit" in entry["prefill"]
        )


# ---- bad arguments ------------------------------------------------------------------------------
@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(make_profile(as_dict=True)))
    return path


@pytest.mark.parametrize(
    "change, message",
    [
        ({"--workload": "azure_chat"}, "unknown trace 'azure_chat'"),
        ({"--slo": "ttft=200,tpot=50ms"}, "give a number with a unit, ms or s"),
        ({"--devices": "1"}, "--devices must be >= 2"),
        ({"--model": "llama"}, "was measured for model 'Toy-1'"),
        ({"--workload": "synthetic:10"}, "synthetic:PROMPT_LEN:OUTPUT_LEN"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(change, message, profile_path, capsys):
    args = {
        "--profile": str(profile_path),
        "--workload": "synthetic:100:10",
        "--slo": "ttft=1s,tpot=100ms",
        "--devices": "4",
        **change,
    }
    rc = cli.main(["tune"] + [x for kv in args.items() for x in kv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "mangle, message",
    [
        (lambda d: "{not json", "not JSON"),
        (lambda d: {**d, "schema": "other/1"}, "schema: expected 'pdserve-profile/1'"),
        (
            lambda d: {**d, "tp": {"1": {**d["tp"]["1"], "decode": {"coef": [0.1, -1, 0]}}}},
            "tp.1.decode.coef",
        ),
        (lambda d: {k: v for k, v in d.items() if k != "kv_transfer"}, "kv_transfer: missing"),
        (lambda d: {**d, "tp": {"2": d["tp"]["1"]}}, "2 does not divide"),
    ],
)
def test_malformed_profiles_exit_2_naming_the_key(mangle, message, tmp_path, capsys):
    data = mangle(make_profile(as_dict=True))
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(ProfileError, match=re.escape(message)):
        load_profile(path)
    rc = cli.main(tune_argv(str(path), "synthetic:100:10", "ttft=1s,tpot=100ms", 4))
    err = capsys.readouterr().err
    assert rc == 2 and message in err and str(path) in err


def test_no_rate_meets_an_impossible_slo(profile_path, capsys):
    rc = cli.main(tune_argv(str(profile_path), "synthetic:100:10", "ttft=1ms,tpot=1ms", 2))
    assert rc == 1 and "no placement meets the SLO" in capsys.readouterr().err


# ---- deployable answers -------------------------------------------------------------------------
def _tune_derived(tmp_path, *extra):
    out = tmp_path / "best.yaml"
    args = tune_argv(
        str(DERIVED),
        "azure_conv",
        "ttft=1s,tpot=50ms,attainment=0.9",
        4,
        "--tp",
        "1,2",
        "--time-limit",
        "10",
        "--model",
        "/models/Meta-Llama-3-8B",
        "--out",
        str(out),
        *extra,
    )
    return cli.main(args), out


def test_gpu_tp2_prefill_and_decode_are_left_out_as_the_launcher_refuses_them(tmp_path, capsys):
    rc, out = _tune_derived(tmp_path, "--colocated")
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "placements left out, refused by `pdserve up` today" in text
    rows = text.split("  status\n", 1)[1].split("\n\n", 1)[0].splitlines()
    for row in rows:
        if "P tp" in row:  # disaggregated rows: tp 1 only
            assert "tp2" not in row, row
        if not row.lstrip().startswith("..."):
            assert " simulated " in row or " estimated " in row, row
    assert "* basis: 'simulated' rows were run whole" in text
    assert_launchable(out, load_profile(DERIVED))


def test_the_launcher_refuses_tp2_on_gpu_disaggregated_but_not_colocated():
    prof = load_profile(DERIVED)
    for pl, refused in [
        (Placement(PoolSpec(2, 2), PoolSpec(4, 1)), True),
        (Placement(PoolSpec(4, 1), PoolSpec(2, 2)), True),
        (Placement(PoolSpec(4, 1), PoolSpec(4, 1)), False),
        (Placement(None, PoolSpec(4, 2)), False),
    ]:
        cfg = validate_config(deploy_yaml(Candidate(pl), prof, "/m/Meta-Llama-3-8B", "grpc"))
        assert bool(fit_problems(cfg, hf_config(prof))) == refused, pl.label()
    shm = deploy_yaml(Candidate(Placement(PoolSpec(4), PoolSpec(4))), prof, "/m/x", "shm")
    assert "kvtransfer.backend" in fit_problems(validate_config(shm), hf_config(prof))[0]


def test_out_without_model_is_refused_for_a_hub_id(tmp_path, capsys):
    rc = cli.main(
        tune_argv(
            str(DERIVED), "azure_conv", "ttft=1s,tpot=50ms", 8, "--out", str(tmp_path / "x.yaml")
        )
    )
    err = capsys.readouterr().err
    assert rc == 2 and "--out needs --model" in err and not (tmp_path / "x.yaml").exists()


def test_router_and_ray_settings_reach_the_yaml(tmp_path, capsys):
    rc, out = _tune_derived(
        tmp_path, "--router-host", "10.0.0.5", "--router-port", "6000", "--ray-address", "auto"
    )
    assert rc == 0, capsys.readouterr().out
    cfg = load_config(out)
    assert cfg.model == "/models/Meta-Llama-3-8B"
    assert (cfg.router.host, cfg.router.port, cfg.ray.address) == ("10.0.0.5", 6000, "auto")
    assert cfg.ray.num_cpus is None
    assert_launchable(out, load_profile(DERIVED))


def test_mooncake_prefix_blocks_are_named_as_not_simulated(profile_path, capsys):
    rc = cli.main(
        tune_argv(
            str(profile_path),
            "mooncake_synthetic",
            "ttft=10s,tpot=1s",
            2,
            "--scale",
            "0.01",
            "--time-limit",
            "5",
        )
    )
    text = capsys.readouterr().out
    assert rc in (0, 1) and "note: prefix caching is not simulated" in text
