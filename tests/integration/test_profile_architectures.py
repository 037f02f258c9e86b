"""`pdserve profile` and `pdserve tune` on models of the families beyond Llama (a sliding-window
model, a soft-capped one with mixed windows, two mixtures of experts; tests/arch_helpers.py): the
quick profile measures each, and the tuner places a workload from that profile. Nothing in either
command may assume the Llama family."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from arch_helpers import build_arch_model

KINDS = ["mistral-sw", "gemma2", "qwen2-moe"]


@pytest.mark.parametrize("kind", KINDS)
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
