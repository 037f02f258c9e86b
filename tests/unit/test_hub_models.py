"""Models named by Hugging Face Hub id (engine/loader/hub.py, resolve.py), offline, against a hub
cache each test builds in the library's own layout (tests/helpers/hub.py) under tmp_path: `ORG/NAME`
and `ORG/NAME@REVISION` resolve to the cache's snapshot and the engine serves it as it serves the
directory it came from; an id not in the cache, a revision not in it, and a snapshot with only GGUF
files are refused in one line that says what to do; a local directory spelled like an id wins over
the Hub. HF_HUB_OFFLINE=1 throughout: nothing is downloaded, no socket opens."""

from __future__ import annotations

import pathlib
import shutil

import pytest

from helpers.hub import COMMIT, add_to_hub_cache
from pdserve.engine.loader import resolve_model
from pdserve.engine.loader.hub import parse_hub_id

REPO = "tiny-org/tiny-llama"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache under tmp_path, offline. huggingface_hub reads its environment once, at
    import, so the library's constants are set as the variables would have set them."""
    from huggingface_hub import constants

    home = tmp_path / "hf"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_ids_are_told_from_paths():
    assert parse_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        None,
    )
    assert parse_hub_id("org/name@v1.0") == ("org/name", "v1.0")
    assert parse_hub_id(f"org/name@{COMMIT}") == ("org/name", COMMIT)
    for not_an_id in ("smollm2", "./org/name", "/org/name", "org/name/x", "org--x/name", "org/",
                      "~/name", "org/name@", "org/-name", "org/na..me", "org/name.gguf@ v"):  # fmt: skip
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_an_id_resolves_to_its_snapshot_and_the_engine_serves_it(hub_cache, tiny_models):
    from pdserve.engine import LLM, SamplingParams

    model_dir, _ = tiny_models("llama-gqa")
    snapshot = add_to_hub_cache(hub_cache, REPO, pathlib.Path(model_dir))
    assert resolve_model(REPO) == snapshot
    assert resolve_model(f"{REPO}@main") == snapshot
    assert resolve_model(f"{REPO}@{COMMIT}") == snapshot
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = []
    for model in (model_dir, REPO):
        llm = LLM(model, dtype="float32", kv_cache_memory=4 << 20)
        out = llm.generate([[5, 6, 7, 8], [9, 10]], greedy, use_tqdm=False)
        outputs.append([list(o.outputs[0].token_ids) for o in out])
        llm.shutdown()
    assert outputs[0] == outputs[1]


def test_an_id_not_in_the_cache_offline_says_what_to_do(hub_cache, tiny_models):
    with pytest.raises(ValueError) as e:
        resolve_model("nobody/nothing")
    message = str(e.value)
    assert "\n" not in message and message.startswith("model: 'nobody/nothing'")
    for fix in ("HF_HUB_OFFLINE=0", "huggingface-cli download nobody/nothing", "local directory"):
        assert fix in message, message
    assert str(hub_cache) in message  # where it looked
    model_dir, _ = tiny_models("llama-gqa")
    add_to_hub_cache(hub_cache, REPO, pathlib.Path(model_dir))
    with pytest.raises(ValueError) as e:
        resolve_model(f"{REPO}@v2")
    assert "revision 'v2'" in str(e.value) and f"download {REPO} --revision v2" in str(e.value)


def test_a_local_directory_spelled_like_an_id_wins_over_the_hub(
    hub_cache, tiny_models, tmp_path, monkeypatch
):
    model_dir, _ = tiny_models("llama-gqa")
    add_to_hub_cache(hub_cache, REPO, pathlib.Path(model_dir))
    monkeypatch.chdir(tmp_path)
    shutil.copytree(model_dir, tmp_path / REPO)
    assert resolve_model(REPO) == pathlib.Path(REPO)
    # a local path of that name that is no model is refused as such, not looked up on the Hub
    shutil.rmtree(tmp_path / REPO)
    (tmp_path / REPO).mkdir()
    with pytest.raises(ValueError, match="directory has no config.json"):
        resolve_model(REPO)


def test_a_snapshot_of_gguf_files_only_is_refused(hub_cache, tmp_path):
    gguf_only = tmp_path / "gguf-repo"
    gguf_only.mkdir()
    (gguf_only / "model.Q4_K_M.gguf").write_bytes(b"GGUF")
    add_to_hub_cache(hub_cache, "org/model-GGUF", gguf_only)
    with pytest.raises(ValueError) as e:
        resolve_model("org/model-GGUF")
    message = str(e.value)
    assert "\n" not in message and "holds GGUF files but no safetensors" in message
    assert "hf download org/model-GGUF FILE.gguf" in message
