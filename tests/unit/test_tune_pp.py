"""The tuner searches pipeline stages for the prefill pool (issue 53, item 4): the profile's keys
that price stages and nodes (and their defaults for old profiles), the step and KV model of a
worker of tp x pp ranks, the search choosing stages where a tensor-parallel group would pay its
all-reduces over a slow link between nodes (and not where the link is fast, nor on one H100
node), the report's reasons, the YAML's `pp`, and the derived H100 profiles."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from helpers.tuning import DERIVED, MODEL, make_profile
from pdserve import cli
from pdserve.deploy.config.load import load_config, validate_config
from pdserve.tuning import derive_profile
from pdserve.tuning.deploy_yaml import deploy_yaml, launcher_problems
from pdserve.tuning.perf_model import (
    DEFAULT_INTER_NODE,
    ProfileError,
    load_profile,
    profile_dict,
    profile_from_dict,
)
from pdserve.tuning.simulator import Placement, PoolSpec, Simulator
from pdserve.tuning.slo import parse_slo
from pdserve.tuning.tune_report import pp_notes
from pdserve.tuning.tuner import Search, enumerate_placements, pp_dominated
from pdserve.tuning.workload import synthetic

SEVENTY = DERIVED.parent / "h100_llama3_70b.json"


# ---- the profile ---------------------------------------------------------------------------------
def test_an_old_profile_loads_with_the_documented_defaults():
    prof = make_profile(tps=(1, 3))  # none of the keys that price stages and nodes
    assert prof.devices_per_node is None and prof.nodes_spanned(64) == 1
    assert prof.inter_node == DEFAULT_INTER_NODE and prof.intra_node is None
    assert prof.hidden_size == MODEL["hidden_size"] and prof.activation_bytes == 4  # float32
    assert prof.weight_bytes == 0 and prof.usable_memory_bytes_per_device is None
    # one node, one stage: the step model is the profiled one, untouched
    assert prof.placed_step_model(3, 1) is prof.step_model(3)
    # no memory figures: each stage rank keeps a rank's KV budget for 1/pp of the layers
    assert prof.kv_capacity(3, 4) == 4 * prof.kv_capacity(3, 1)


def test_hidden_size_defaults_to_heads_times_the_head_size_kv_bytes_imply():
    data = make_profile(as_dict=True)
    del data["model"]["hidden_size"], data["model"]["head_dim"]
    data["kv_bytes_per_token"] = 2 * 10 * 3 * 64 * 4  # K and V, 10 layers, 3 KV heads of 64, fp32
    assert profile_from_dict(data).hidden_size == 6 * 64


@pytest.mark.parametrize(
    "where, value, words",
    [
        ("hardware.devices_per_node", 0, "devices_per_node: expected an integer > 0"),
        ("hardware.devices_per_node", 2.5, "devices_per_node: expected an integer > 0"),
        (
            "hardware.inter_node",
            {"latency_s": 0.0},
            "hardware.inter_node: bandwidth_bytes_per_s must be > 0",
        ),
        ("hardware.inter_node", {"bandwidth_bytes_per_s": 1e9, "latency_s": -1}, "latency_s >= 0"),
        ("hardware.intra_node", 5, "hardware.intra_node: expected"),
        ("model.weight_bytes", -1, "model.weight_bytes: expected a number > 0"),
        ("tp.1.kv_capacity_tokens", -1, "must be >= 0"),
    ],
)
def test_bad_placing_keys_are_named(where, value, words):
    data = make_profile(as_dict=True)
    *path, key = where.split(".")
    section = data
    for k in path:
        section = section[k]
    section[key] = value
    with pytest.raises(ProfileError, match=words.replace("(", r"\(").replace(".", r"\.")):
        profile_from_dict(data, "p.json")


# ---- the step and KV model of tp x pp ranks --------------------------------------------------------
def _nodes_profile(link_bw: float, link_lat: float = 20e-6, device="gpu", as_dict=False):
    """A 16-KV-head model of 80 layers (hidden 4096, bf16) on nodes of 8 devices of 10 GB for
    weights and KV each, 100 GB of weights: one stage of tp 8 holds no KV (8 x 10 < 100), two
    do, as does one of tp 16; `link_bw`: the inter-node link."""
    model = dict(
        id="Big-1",
        name="big",
        num_layers=80,
        num_heads=32,
        num_kv_heads=16,
        head_dim=128,
        hidden_size=4096,
        dtype="bfloat16",
        weight_bytes=100e9,
    )
    kvb = 2 * 80 * 16 * 128 * 2
    usable = 10e9
    tp = {
        8: ((0.005, 20e-6, 0.0), (0.010, 2e-4, 1e-8)),
        16: ((0.003, 10e-6, 0.0), (0.008, 1e-4, 5e-9)),
    }
    data = profile_dict(
        model=model,
        kv_bytes_per_token=kvb,
        hardware={
            "device": device,
            "devices_per_node": 8,
            "usable_memory_bytes_per_device": usable,
            "inter_node": {"bandwidth_bytes_per_s": link_bw, "latency_s": link_lat},
            "intra_node": {"bandwidth_bytes_per_s": 300e9, "latency_s": 10e-6},
        },
        tp={
            t: {
                "prefill": {"coef": list(p)},
                "decode": {"coef": list(d)},
                "kv_capacity_tokens": max(0, int((t * usable - 100e9) // kvb)),
            }
            for t, (p, d) in tp.items()
        },
        kv_transfer={"torch": {"bandwidth_bytes_per_s": 50e9, "latency_s": 50e-6}},
    )
    return data if as_dict else profile_from_dict(data)


def test_one_kv_head_takes_any_tp_and_others_must_divide():
    """An MLA model's profile has one KV head (its latent, on every rank): any TP degree that
    divides the attention heads is read; otherwise TP must divide the KV heads."""
    data = _nodes_profile(10e9, as_dict=True)
    data["model"]["num_kv_heads"] = 1
    assert sorted(profile_from_dict(data).tp) == [8, 16]
    data["model"]["num_kv_heads"] = 4
    with pytest.raises(ProfileError, match="8 does not divide the model's 32 heads and 4 KV"):
        profile_from_dict(data, "p.json")


def test_a_tp_group_across_nodes_pays_its_all_reduces_over_the_link():
    prof = _nodes_profile(10e9, 50e-6)
    h_bytes = 4096 * 2
    per_token = 2 * 80 * 2 * 15 / 16 * h_bytes / 10e9  # 2 all-reduces a layer, a ring of 16
    c = prof.pp_costs(16, 1)
    assert c.allreduce_fixed_s == pytest.approx(2 * 80 * 50e-6)
    assert c.allreduce_per_token_s == pytest.approx(per_token)
    assert c.handoff_s(1000) == 0.0
    a, b, cc = prof.placed_step_model(16, 1).prefill
    assert (a, b, cc) == pytest.approx((0.003 + 160 * 50e-6, 10e-6 + per_token, 0.0))
    da, db, _ = prof.placed_step_model(16, 1).decode  # a decode step's tokens, the same
    assert (da, db) == pytest.approx((0.008 + 160 * 50e-6, 1e-4 + per_token))
    assert prof.pp_costs(8, 1).fixed_s == 0.0  # tp 8 stays on its node


def test_stages_take_turns_and_pay_their_hand_offs():
    prof = _nodes_profile(10e9, 50e-6)
    h_bytes = 4096 * 2
    c = prof.pp_costs(8, 2)  # stage 0 on node 0, stage 1 on node 1
    # hidden states and residual to stage 1, then the final hidden states back, both across
    assert c.node_crossings == 1 and c.allreduce_s(1000) == 0.0
    assert c.handoff_fixed_s == pytest.approx(2 * 50e-6)
    assert c.handoff_per_token_s == pytest.approx(3 * h_bytes / 10e9)
    # the compute is all the layers' at tp 8, one stage after the other: no faster than one stage
    one, two = prof.step_model(8).prefill_time(2048, 0), prof.placed_step_model(8, 2)
    assert two.prefill_time(2048, 0) == pytest.approx(one + c.handoff_s(2048))
    # four stages of tp 2 on one node: hand-offs over the intra-node link only
    c4 = prof.pp_costs(2, 4)
    assert c4.node_crossings == 0
    assert c4.handoff_per_token_s == pytest.approx((3 * 2 + 1) * h_bytes / 300e9)


def test_stages_make_room_that_one_stage_lacks():
    prof = _nodes_profile(10e9)
    kvb = prof.kv_bytes_per_token
    assert prof.kv_capacity(8, 1) == 0  # 80 GB of devices, 100 GB of weights
    assert prof.kv_capacity(8, 2) == int((16 * 10e9 - 100e9) // kvb) == prof.kv_capacity(16, 1)
    assert prof.kv_capacity(8, 4) == int((32 * 10e9 - 100e9) // kvb)
    assert prof.placed_step_model(8, 2).kv_capacity_tokens == prof.kv_capacity(8, 2)


def test_decode_pools_never_take_stages():
    prof = _nodes_profile(10e9)
    with pytest.raises(ValueError, match="pp=1"):
        Simulator(prof, Placement(PoolSpec(1, 16), PoolSpec(1, 8, pp=2)))
    for pl in enumerate_placements(prof, 32, colocated=True):
        assert pl.decode.pp == 1


# ---- the search ------------------------------------------------------------------------------------
def _tune(prof, devices=32):
    """The search on long prompts and short answers (the prefill pool is the bottleneck), and
    its notes on stages for a full 2048-token step."""
    reqs = synthetic(400, 1.0, 2048, 8, seed=0)
    slo = parse_slo("ttft=2s,tpot=300ms,attainment=0.9")
    search = Search(prof, reqs, slo, num_requests=200, max_requests=1500, max_verify_requests=3000)
    placements = enumerate_placements(prof, devices, min_kv_tokens=2048)
    cands = search.run(placements, verify_top=2, deadline_s=None)
    best = cands[0]
    notes = pp_notes(
        prof, cands, best, tokens=2048, num_devices=devices, min_kv_tokens=2048, unit="GPU"
    )
    staged, wide = search.instances[("prefill", 8, 2)], search.instances[("prefill", 16, 1)]
    assert not (staged.capped or wide.capped)  # the goodputs are found, not bounded
    return placements, best, "\n".join(notes), staged.goodput / wide.goodput


def test_a_slow_link_between_nodes_makes_the_tuner_stage_the_prefill_pool():
    """Two nodes of 8 for the prefill worker (and two more for decode, which one stage of tp 8
    cannot hold either): over a 10 GB/s link a tp 16 group's 160 all-reduces a step cost more
    than two stages of tp 8 and their two hand-offs."""
    prof = _nodes_profile(10e9, 50e-6)
    placements, best, notes, ratio = _tune(prof)
    shapes = {(p.prefill.tp, p.prefill.pp) for p in placements}
    assert shapes == {(8, 2), (16, 1)}, shapes  # both were searched
    assert ratio > 1  # two stages of tp 8 serve more prompts than one worker of tp 16
    assert best.status == "simulated" and best.goodput > 0
    assert (best.placement.prefill.tp, best.placement.prefill.pp) == (8, 2), best.placement
    assert best.placement.decode.tp == 16 and best.placement.decode.pp == 1
    ar_ms = prof.pp_costs(16, 1).allreduce_s(2048) * 1e3
    assert "prefill pp 2 x tp 8 chosen" in notes, notes
    assert (
        f"a tp 16 group would span 2 nodes of 8 GPUs; its all-reduces over the inter-node link cost {ar_ms:.1f} ms"
        in notes
    ), notes
    assert "tp 8 in one stage holds 0" in notes, notes


def test_a_fast_link_between_nodes_keeps_the_prefill_pool_in_one_stage():
    prof = _nodes_profile(1e12, 5e-6)
    placements, best, notes, ratio = _tune(prof)
    assert ratio < 1  # one prefill worker of tp 16 serves more than two stages of tp 8
    assert {(p.prefill.tp, p.prefill.pp) for p in placements} == {(8, 2), (16, 1)}
    assert (best.placement.prefill.tp, best.placement.prefill.pp) == (16, 1), best.placement
    assert "not chosen: the best runs prefill tp 16 in one stage, which would span 2 nodes" in notes
    assert "tp 8 pp 2: searched" in notes, notes


def test_on_one_h100_node_stages_are_not_searched_and_the_report_says_why():
    prof = load_profile(DERIVED)
    assert prof.devices_per_node == 8
    placements = enumerate_placements(prof, 8, min_kv_tokens=8192)
    assert placements and all(p.prefill.pp == 1 for p in placements)
    # every degree holds a long prompt's KV in one stage: pp workers of it do better
    assert all(pp_dominated(prof, t, 2, 8192) for t in prof.tp_degrees)
    staged, one = prof.placed_step_model(1, 2), prof.step_model(1)
    assert staged.prefill_time(2048, 2048**2) > one.prefill_time(2048, 2048**2)


def test_the_70b_profile_stages_only_where_one_stage_has_no_room():
    prof = load_profile(SEVENTY)
    assert prof.kv_capacity(1) == 0 and prof.kv_capacity(1, 2) > 0 and prof.kv_capacity(2) > 0
    shapes = {
        (p.prefill.tp, p.prefill.pp) for p in enumerate_placements(prof, 8, min_kv_tokens=8192)
    }
    assert (1, 2) in shapes and (1, 1) not in shapes  # tp 1 fits only in stages
    assert not any(pp > 1 for t, pp in shapes if t > 1)  # tp 2 and up hold a prompt in one stage
    assert all(p.decode.tp >= 2 for p in enumerate_placements(prof, 8))


def test_tune_cli_prints_why_on_the_h100_profile(capsys):
    argv = [
        "tune",
        "--profile",
        str(DERIVED),
        "--workload",
        "synthetic:1024:64",
        "--slo",
        "ttft=1s,tpot=50ms",
        "--devices",
        "8",
        "--num-requests",
        "100",
        "--max-requests",
        "600",
        "--max-verify-requests",
        "1200",
        "--verify-top",
        "1",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "prefill pp (8 GPUs a node" in out
    assert "not chosen: the best runs prefill tp 1 in one stage, which stays on one node" in out
    assert "tp 1: not searched in stages: one stage holds 450911 KV tokens" in out


def test_tune_writes_the_stages_it_chose_into_the_yaml(tmp_path, capsys):
    """The same slow-link case as a CPU profile (which `pdserve up` runs in stages), through
    `pdserve tune --out`: the YAML's prefill pool is tp 8 x pp 2, and the launcher's offline
    checks take it."""
    path, out = tmp_path / "big.json", tmp_path / "best.yaml"
    path.write_text(json.dumps(_nodes_profile(10e9, 50e-6, device="cpu", as_dict=True)))
    argv = [
        "tune", "--profile", str(path), "--workload", "synthetic:2048:8", "--slo",
        "ttft=2s,tpot=300ms", "--devices", "32", "--num-requests", "200", "--max-requests",
        "1500", "--max-verify-requests", "3000", "--verify-top", "2", "--model", "/models/big",
        "--out", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "best: 1P tp8 pp2 + 1D tp16" in text and "prefill pp 2 x tp 8 chosen" in text, text
    cfg = load_config(out)
    assert (cfg.pools.prefill.tp, cfg.pools.prefill.pp) == (8, 2)
    assert (cfg.pools.decode.tp, cfg.pools.decode.pp) == (16, 1)
    assert cfg.ray.num_cpus == 32
    assert launcher_problems(yaml.safe_load(out.read_text()), load_profile(path)) == []


def test_a_refused_best_is_ranked_with_include_refused_but_never_written(tmp_path, capsys):
    out = tmp_path / "best.yaml"
    argv = [
        "tune", "--profile", str(SEVENTY), "--workload", "synthetic:1024:64", "--slo",
        "ttft=2s,tpot=100ms", "--devices", "8", "--num-requests", "100", "--max-requests",
        "600", "--max-verify-requests", "1200", "--verify-top", "1", "--include-refused",
        "--model", "/models/Meta-Llama-3-70B", "--out", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert "ranked anyway (--include-refused; never written)" in captured.out
    assert "refuses" in captured.err and "--out writes none" in captured.err
    assert not out.exists()
    assert cli.main(argv[:-5] + ["--no-pp"]) == 2  # without: every placement is refused
    assert "--include-refused ranks them anyway" in capsys.readouterr().err


# ---- the YAML --------------------------------------------------------------------------------------
def test_the_yaml_carries_the_prefill_pools_stages():
    from pdserve.tuning.tuner import Candidate

    cpu = make_profile(tps=(1, 3))
    pl = Placement(PoolSpec(1, 3, pp=2), PoolSpec(1, 1))
    data = deploy_yaml(Candidate(pl), cpu, "smollm2", "grpc")
    cfg = validate_config(data)
    assert (cfg.pools.prefill.tp, cfg.pools.prefill.pp, cfg.pools.decode.pp) == (3, 2, 1)
    assert cfg.ray.num_cpus == 3 * 2 + 1
    gpu = make_profile(tps=(1, 3), device="gpu")
    data = deploy_yaml(
        Candidate(Placement(PoolSpec(1, 1, pp=2), PoolSpec(1, 1))), gpu, "smollm2", "grpc"
    )
    assert any(
        "pools.prefill.pp: 2 on GPUs is refused today" in p for p in launcher_problems(data, gpu)
    )


# ---- the derived profiles --------------------------------------------------------------------------
@pytest.mark.parametrize("shape", list(derive_profile.FILES), ids=lambda s: s.id)
def test_the_shipped_h100_profiles_are_what_derive_profile_writes(shape):
    shipped = json.loads((derive_profile.PROFILES / derive_profile.FILES[shape]).read_text())
    built = json.loads(derive_profile.text(shape))
    for t, entry in built["tp"].items():
        for kind in ("prefill", "decode"):
            assert entry[kind]["samples"] == shipped["tp"][t][kind]["samples"]
            # the fit's last digits move with numpy's LAPACK
            assert shipped["tp"][t][kind]["coef"] == pytest.approx(entry[kind]["coef"], rel=1e-6)
        assert entry["kv_capacity_tokens"] == shipped["tp"][t]["kv_capacity_tokens"]
    for key in ("model", "hardware", "kv_transfer", "kv_bytes_per_token", "derived"):
        assert built[key] == shipped[key]


def test_the_70b_profile_is_the_8b_model_at_70b_shape():
    small, big = load_profile(DERIVED), load_profile(SEVENTY)
    assert big.derived and big.num_layers == 80 and big.hidden_size == 8192
    assert big.num_kv_heads == 8 and big.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    # prefill per token at tp 8 grows about as the parameters do (compute-bound linears)
    ratio = big.step_model(8).prefill[1] / small.step_model(8).prefill[1]
    assert 70.6 / 8.03 * 0.8 < ratio < 70.6 / 8.03 * 1.2, ratio
    assert math.isclose(big.weight_bytes, 2 * 70.6e9)
