"""kvtransfer.backend "auto" ranked by a `pdserve profile` (kvtransfer/choose.py): the order a
profile's measured hand-offs give, what a decode worker serves and offers by it, what a prefill
worker picks from those offers on the decode worker's host and on another, the built-in order
without a profile, the `kvtransfer.profile` key's checks, and the start table's line. The cluster
over nixl picked this way: tests/integration/test_auto_rank_nixl_cluster.py."""

from __future__ import annotations

import json

import pytest

from pdserve.deploy.config.load import ConfigError, validate_config
from pdserve.deploy.start_table import auto_pick, format_table
from pdserve.kvtransfer import choose
from pdserve.kvtransfer.choose import DEFAULT, Ranking, ranking_from_profile
from pdserve.protos.pdserve.v1 import worker_pb2

ALL = ("grpc", "shm", "torch", "nixl")
NO_NIXL = ("grpc", "shm", "torch")


def profile(same: dict, cross: dict | None = None, kv_bytes: int = 8192) -> dict:
    """A profile's keys that ranking reads: backend -> GB/s (latency 0.1 ms), and the machine."""

    def figures(gbs):
        return {b: {"bandwidth_bytes_per_s": g * 1e9, "latency_s": 1e-4} for b, g in gbs.items()}

    data = {
        "kv_bytes_per_token": kv_bytes,
        "kv_transfer": figures(same),
        "hardware": {"name": "AMD EPYC test"},
        "source": {"date": "2026-11-30T03:00:00+00:00"},
    }
    if cross is not None:
        data["kv_transfer_cross_host"] = figures(cross)
    return data


def test_a_profile_where_nixl_beats_shm_ranks_nixl_first():
    r = ranking_from_profile(
        profile({"grpc": 1.5, "shm": 2.0, "nixl": 9.0, "torch": 1.0}), "p", ALL
    )
    assert r.same_host == ("nixl", "shm", "grpc", "torch")  # torch measured slowest
    assert r.cross_host == ("grpc",)  # no figures between hosts: grpc alone
    assert "profile p, 2026-11-30, measured on AMD EPYC test" in r.source
    # a decode worker with its pool in host memory serves nixl (first here), shm and grpc
    assert r.served(on_host=True, available=ALL) == ("nixl", "shm", "grpc")
    assert r.pick(["nixl", "shm", "grpc"], same_host=True) == "nixl"
    assert r.pick(["nixl", "shm", "grpc"], same_host=False) == "grpc"


def test_a_profile_where_shm_wins_ranks_shm_first_and_serves_no_nixl():
    r = ranking_from_profile(profile({"grpc": 1.5, "shm": 9.4, "nixl": 2.6}), "p", ALL)
    assert r.same_host == ("shm", "nixl", "grpc")
    assert r.served(on_host=True, available=ALL) == ("shm", "grpc")
    # a GPU pool (no shm): nixl is the fastest this worker can serve, so it serves it
    assert r.served(on_host=False, available=ALL) == ("nixl", "grpc")


def test_cross_host_figures_rank_the_other_hosts_order_without_shm():
    r = ranking_from_profile(
        profile({"grpc": 1.5, "shm": 9.4}, cross={"grpc": 1.0, "nixl": 5.0, "shm": 99.0}),
        "p",
        ALL,
    )
    assert r.same_host == ("shm", "grpc") and r.cross_host == ("nixl", "grpc")
    assert r.served(on_host=True, available=ALL) == ("shm", "grpc", "nixl")
    assert r.pick(["shm", "grpc", "nixl"], same_host=False) == "nixl"


def test_latency_counts_for_a_reference_prompt():
    slow_start = profile({"grpc": 1.0, "torch": 1.2})
    slow_start["kv_transfer"]["torch"]["latency_s"] = 1.0  # a second per hand-off
    # grpc is faster for it, torch next, shm (not measured) after them
    assert ranking_from_profile(slow_start, "p", ALL).same_host == ("grpc", "torch", "shm")


def test_no_profile_gives_the_built_in_order():
    assert choose.load_ranking(None) is DEFAULT
    assert DEFAULT.same_host == ("shm", "grpc") and DEFAULT.cross_host == ("grpc",)
    assert DEFAULT.served(on_host=True, available=ALL) == ("shm", "grpc")
    assert DEFAULT.served(on_host=False, available=ALL) == ("grpc",)
    assert Ranking.from_dict(None) is DEFAULT


def test_a_backend_not_installed_is_never_ranked_served_or_picked(monkeypatch):
    data = profile({"grpc": 1.5, "shm": 2.0, "nixl": 9.0})
    r = ranking_from_profile(data, "p", NO_NIXL)
    assert "nixl" not in r.same_host
    # ranked where it is installed (the launcher's machine), served only where it is
    everywhere = ranking_from_profile(data, "p", ALL)
    assert everywhere.served(on_host=True, available=NO_NIXL) == ("shm", "grpc")
    # and a sender without NIXL never takes a nixl offer
    monkeypatch.setattr(choose, "installed", lambda: NO_NIXL)
    offer = worker_pb2.KVEndpoint(backend="nixl", address="nixl://x?control=a:1&tp=1")
    assert not choose.applies(offer)


def offers(*items, host=None):
    e = worker_pb2.KVEndpoint(backend="grpc", address="127.0.0.1:1")
    for backend, cross_rank in items:
        e.offers.add(
            backend=backend,
            address=f"{backend}-address",
            locality="boot:1:2" if backend == "shm" else "",
            host=choose.host_id() if host is None else host,
            cross_host_rank=cross_rank,
        )
    return e


def test_a_sender_follows_the_decode_workers_order_for_where_it_runs(monkeypatch):
    monkeypatch.setattr(choose, "locality", lambda address: "boot:1:2")
    monkeypatch.setattr(choose, "installed", lambda: ALL)
    endpoint = offers(("nixl", 0), ("shm", 0), ("grpc", 1))  # nixl first on its host
    assert [o.backend for o in choose.choices(endpoint)] == ["nixl", "shm", "grpc"]
    far = offers(("shm", 0), ("grpc", 2), ("nixl", 1), host="another-boot-id")
    assert [o.backend for o in choose.choices(far)] == ["nixl", "grpc"]
    monkeypatch.setattr(choose, "installed", lambda: NO_NIXL)  # no NIXL here: the next one
    assert [o.backend for o in choose.choices(endpoint)] == ["shm", "grpc"]
    legacy = offers(("grpc", 0), ("shm", 0), ("nixl", 0), host="")  # no ranking sent
    assert [o.backend for o in choose.choices(legacy)] == ["shm", "grpc"]


def test_a_malformed_ranking_in_a_worker_config_is_refused():
    with pytest.raises(ValueError, match="grpc in both orders"):
        Ranking.from_dict({"same_host": ["shm"], "cross_host": ["grpc"]})
    with pytest.raises(ValueError, match="shm"):
        Ranking.from_dict({"same_host": ["grpc"], "cross_host": ["shm", "grpc"]})
    from pdserve.decode_worker.server import DecodeWorkerConfig

    with pytest.raises(ValueError, match="KV ranking"):
        DecodeWorkerConfig(model="m", kv_backend="auto", kv_ranking={"same_host": ["x"]} | {
            "cross_host": ["grpc"]
        })  # fmt: skip


def test_the_profile_key_is_read_and_checked(tmp_path):
    good = tmp_path / "profile.json"
    good.write_text(json.dumps(profile({"grpc": 1.5, "shm": 2.0, "nixl": 9.0})))
    cfg = validate_config({"kvtransfer": {"profile": "profile.json"}}, base_dir=tmp_path)
    ranking = cfg.kvtransfer.ranking()
    assert ranking.same_host[0] == "nixl" and str(good) in ranking.source
    assert validate_config({}).kvtransfer.ranking() is DEFAULT
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kv_transfer": {"grpc": {"bandwidth_bytes_per_s": -1}}}))
    with pytest.raises(ConfigError, match="kvtransfer.profile.*bandwidth_bytes_per_s"):
        validate_config({"kvtransfer": {"profile": "bad.json"}}, base_dir=tmp_path)
    with pytest.raises(ConfigError, match="cannot read"):
        validate_config({"kvtransfer": {"profile": "missing.json"}}, base_dir=tmp_path)
    with pytest.raises(ConfigError, match="backend: auto"):
        validate_config(
            {"kvtransfer": {"backend": "grpc", "profile": "profile.json"}}, base_dir=tmp_path
        )


PREFILL = dict(worker_id="prefill-0", role="prefill", node_id="n1")


def test_the_start_table_says_the_order_and_where_it_came_from():
    r = ranking_from_profile(profile({"grpc": 1.5, "shm": 2.0, "nixl": 9.0}), "/p.json", ALL)
    here = dict(
        worker_id="decode-0", role="decode", node_id="n1", kv_backend="auto: nixl, shm, grpc"
    )
    far = dict(here, worker_id="decode-1", node_id="n2")
    assert auto_pick(PREFILL, [here, PREFILL], r) == "auto -> nixl"
    assert auto_pick(PREFILL, [here, far, PREFILL], r) == "auto -> nixl (1), grpc (1)"
    lines = format_table([here, PREFILL], ranking=r).splitlines()
    assert lines[-1] == (
        "KV transfer auto, fastest first: same host nixl > shm > grpc; other hosts grpc "
        "(profile /p.json, 2026-11-30, measured on AMD EPYC test)"
    )
    built_in = format_table([dict(here, kv_backend="auto: shm, grpc"), PREFILL], ranking=DEFAULT)
    assert "auto -> shm" in built_in
    assert built_in.splitlines()[-1].endswith("other hosts grpc (built-in default)")


def test_pdserve_profile_measures_every_installed_backend_by_default(monkeypatch, capsys):
    import argparse

    from pdserve.tuning import profiler

    parser = argparse.ArgumentParser()
    profiler.add_args(parser)
    assert parser.parse_args(["--out", "p.json"]).backends is None  # installed() at run time
    monkeypatch.setattr(choose, "installed", lambda: NO_NIXL)
    args = parser.parse_args(["--out", "p.json", "--backends", "grpc,nixl"])
    assert profiler.run(args) == 2  # before any model is loaded
    assert "nixl, which is not installed here" in capsys.readouterr().err


def test_the_launcher_hands_the_ranking_to_decode_workers_and_prints_it(tmp_path):
    from pdserve.deploy import workers
    from pdserve.deploy.launcher import Cluster

    (tmp_path / "p.json").write_text(json.dumps(profile({"grpc": 1.5, "shm": 2.0, "nixl": 9.0})))
    cfg = validate_config({"kvtransfer": {"profile": "p.json"}}, base_dir=tmp_path)
    ranking = cfg.kvtransfer.ranking()
    decode = workers.worker_config(dict(model="m"), "decode", "auto", True, ranking.to_dict())
    assert Ranking.from_dict(decode.kv_ranking) == ranking
    table = Cluster(config=cfg, started_ray=False).start_table()
    assert table.splitlines()[-2].startswith(
        "KV transfer auto, fastest first: same host nixl > shm > grpc; other hosts grpc (profile "
    )
    named = validate_config({"kvtransfer": {"backend": "grpc"}})
    assert "KV transfer auto" not in Cluster(config=named, started_ray=False).start_table()
