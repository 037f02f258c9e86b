"""`pdserve profile` and `pdserve tune` on models of the families beyond Llama
(tests/helpers/arch.py): the commands end to end on a mixture of experts (the quick profile, then
the tuner places a workload from it), and the profile's engine half (tuning/profile_engine.py) on a
sliding-window model and a soft-capped one with mixed windows, in this process on a smaller grid.
Nothing in either may assume the Llama family."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.arch import build_arch_model

SMALL_GRID = {
    "prefill": [[32], [100], [16] * 4],
    "prefill_reps": 1,
    "batches": (1, 4),
    "contexts": (32, 64),
    "decode_steps": 2,
}


@pytest.mark.parametrize("kind", ["mistral-sw", "gemma2"])
def test_profile_engine_half(tmp_path, kind):
    from types import SimpleNamespace

    from pdserve.tuning.profile_engine import profile_tp

    build_arch_model(tmp_path, kind)
    args = SimpleNamespace(threads_per_rank=1, dtype="float32", kv_cache_memory=1 << 22)
    entry, info = profile_tp(str(tmp_path), 1, SMALL_GRID, args)
    assert info["num_layers"] >= 2 and info["kv_bytes_per_token"] > 0
    assert entry  # the fitted step models of this TP degree


@pytest.mark.parametrize("kind", ["qwen2-moe"])
def test_profile_then_tune(tmp_path, kind):
    model = tmp_path / "model"
    # the quick grid's longest prompt is 1024 tokens
    build_arch_model(model, kind, max_position_embeddings=2048)
    profile = tmp_path / "profile.json"

    def pdserve(*args, timeout=300):
        done = subprocess.run(
            [sys.executable, "-m", "pdserve", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done

    pdserve("profile", "--model", str(model), "--quick", "--backends", "shm", "--out", str(profile))
    data = json.loads(profile.read_text())
    assert data["model"]["num_layers"] >= 2 and data["tp"]
    done = pdserve(
        "tune",
        "--profile",
        str(profile),
        "--workload",
        "synthetic:64:16",
        "--slo",
        "ttft=5s,tpot=1s",
        "--devices",
        "2",
    )
    assert "best: 1P tp1 + 1D tp1" in done.stdout, done.stdout
