"""`pdserve tune` over the shipped derived GPU profile (Llama-3-8B on H100s) and a real trace's
sample, on 8 and 32 devices: the whole search finishes and writes a YAML that `pdserve up` would
launch. It opens no socket and starts no process, but the 32-device search runs some fifty
simulations (seconds of CPU), so it lives here rather than in the fast lane; the tuner's other
CLI tests are tests/unit/test_tuning_cli.py."""

from __future__ import annotations

import time

import pytest

from helpers.tuning import DERIVED, assert_launchable, tune_argv
from pdserve import cli
from pdserve.deploy.config.load import load_config
from pdserve.tuning.perf_model import load_profile


@pytest.mark.parametrize("devices", [8, 32])
def test_gpu_search_finishes(devices, tmp_path, capsys):
    out = tmp_path / "best.yaml"
    t0 = time.perf_counter()
    rc = cli.main(
        tune_argv(
            str(DERIVED),
            "azure_conv",
            "ttft=1s,tpot=50ms,attainment=0.9",
            devices,
            "--colocated",
            "--model",
            "/models/Meta-Llama-3-8B",
            "--out",
            str(out),
        )
    )
    elapsed = time.perf_counter() - t0
    text = capsys.readouterr().out
    assert rc == 0, text
    assert_launchable(out, load_profile(DERIVED))
    cfg = load_config(out)
    pools = [cfg.pools.colocated] if cfg.pools.colocated else [cfg.pools.prefill, cfg.pools.decode]
    assert 2 <= sum(p.replicas * p.tp for p in pools) <= devices
    with capsys.disabled():
        best = text.split("best: ", 1)[1].splitlines()[0]
        print(f"\n[{devices} GPUs] {elapsed:.1f} s: {best}")
