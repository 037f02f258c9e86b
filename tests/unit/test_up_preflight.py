"""`pdserve up --check` on configs that pass (deploy/prechecks.preflight, no port probed: port 0):
it exits 0 and says what only a start can tell, and for a cluster joined by address that its
resources wait for `up`; a local Ray's GPUs are the ones Ray finds, not the YAML's. The refusals
that `--check` and `up` share, against real ports and processes:
tests/integration/test_up_check_same_refusals.py."""

from __future__ import annotations

import pytest

from pdserve.cli import main
from pdserve.deploy import prechecks
from pdserve.deploy.config.load import validate_config
from pdserve.deploy.prechecks import DeployError, preflight


@pytest.fixture
def ok_yaml(tmp_path, tiny_models, monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "ok.yaml"
    path.write_text(
        f"model: {tiny_models('llama-gqa')[0]}\nrouter: {{host: 127.0.0.1, port: 0}}\n"
        f"ray: {{num_cpus: 2, temp_dir: {tmp_path / 'ray'}}}\n"
    )
    return path


def test_check_says_what_it_did_not_check(ok_yaml, capsys):
    assert main(["up", str(ok_yaml), "--check"]) == 0
    out = capsys.readouterr().out
    assert "not knowable before the workers start" in out and "nothing started" in out
    assert "Ray cluster's resources" not in out  # a local Ray's are checked
    assert main(["up", str(ok_yaml), "--check", "--address", "192.0.2.1:6379"]) == 0
    assert "once it has joined 192.0.2.1:6379" in capsys.readouterr().out


def test_a_local_rays_gpus_are_the_ones_ray_finds(tmp_path, tiny_models, monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    data = {
        "model": tiny_models("llama-gqa")[0],
        "router": {"port": 0},
        "ray": {"num_cpus": 2, "temp_dir": str(tmp_path / "ray")},
        "pools": {"prefill": {"resources": {"num_gpus": 1}}, "decode": {}},
    }
    cfg = validate_config(data)
    monkeypatch.setattr(prechecks, "local_gpus", lambda: 0.0)
    with pytest.raises(DeployError) as e:
        preflight(cfg)
    assert "the Ray cluster has 2 CPU, 0 GPU" in str(e.value)
    assert "join a Ray cluster that has them (ray.address, --address)" in str(e.value)
    monkeypatch.setattr(prechecks, "local_gpus", lambda: 1.0)
    assert prechecks.NOT_BEFORE_START in preflight(cfg)  # one GPU here: it fits


def test_a_missing_model_is_refused_here_and_noted_for_a_cluster(tmp_path):
    cfg = validate_config({"model": str(tmp_path / "nothing"), "router": {"port": 0}})
    with pytest.raises(ValueError, match=r"^model: got .*no such file or directory"):
        preflight(cfg)
    notes = preflight(cfg, address="192.0.2.1:6379")
    assert notes[0].startswith("the pools were not checked against the model, not on this")
