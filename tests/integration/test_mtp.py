"""Speculative decoding with a target's own MTP layer (speculative_config method "mtp":
engine/models/mtp.py, run by engine/spec/eagle.py).

Tiny random DeepSeek V3 (latent attention, a sparse MLP in the MTP layer), GLM-4.5 (Llama's
attention with partial rotary and q/k norms), GLM-4.7 Flash (V3's attention, layers typed
dense or sparse, none typed for the MTP layer), Qwen3-Next and Qwen3.5 (hybrids: one gated
full-attention layer under `mtp.*`; Qwen3.5's through a hand-off) targets whose checkpoints
carry one MTP layer (tests/helpers/mtp.py). Every guess the engine makes is recomputed with transformers' decoder
layer of the target's family, and outputs equal those of the target alone, greedy and seeded.
"""

from __future__ import annotations

import pytest

from helpers.arch import build_arch_model
from helpers.eagle import check_head_hand_off, check_head_run
from helpers.engine import KV
from helpers.models import make_tiny_model, random_prompts
from helpers.spec import run_spec
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.loader import safetensors_io
from pdserve.engine.models.mtp import MtpDraft
from pdserve.engine.spec import eagle as spec_eagle
from pdserve.engine.spec.config import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINE = dict(dtype="float32", kv_cache_memory=KV, block_size=4)
MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(autouse=True)
def whole_chains(monkeypatch):
    """(As tests/unit/test_eagle.py: every guess step runs whatever the layer's confidence.)"""
    monkeypatch.setattr(spec_eagle, "CONTINUE_AT", 0.0)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """kind (a tests/helpers/mtp.py kind) -> (its directory, the HF target, the reference)."""
    from helpers.mtp import make_mtp_target

    cache = {}

    def get(kind: str):
        if kind not in cache:
            path = tmp_path_factory.mktemp(f"mtp-{kind}")
            hf, tensors = make_mtp_target(path, kind)
            cache[kind] = (str(path), hf, tensors)
        return cache[kind]

    return get


def _prompts(n: int) -> list[list[int]]:
    return random_prompts([5 + (9 * i) % 40 for i in range(n)], seed=3)


@pytest.mark.parametrize("kind", ["deepseek-v3", "glm4-moe", "glm4-moe-lite", "qwen3-next"])
def test_guesses_are_the_mtp_layers_and_tokens_the_targets(
    targets, always_speculate, monkeypatch, kind
):
    """Each guess is the MTP layer's most likely token given the target's states before it and
    the layer's own output after them; the output is the target's; the runner reads only the
    MTP layer's tensors from the checkpoint (not the target's again)."""
    model_dir, hf, tensors = targets(kind)
    read = []
    load = MtpDraft.load_weights
    monkeypatch.setattr(
        MtpDraft,
        "load_weights",
        lambda self, w: load(self, (read.append(n) or (n, t) for n, t in w)),
    )
    check_head_run(model_dir, hf, MTP, tensors, monkeypatch, _prompts(5), **ENGINE)
    prefix = "mtp." if kind.startswith("qwen") else f"model.layers.{hf.config.num_hidden_layers}."
    assert read and all(n.startswith(prefix) for n in read)
    assert not any("embed_tokens" in n or "shared_head.head" in n for n in read)


def test_seeded_sampling_equal_without_speculation(targets, always_speculate):
    model_dir, _, _ = targets("deepseek-v3")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=30, ignore_eos=True)
    prompts = _prompts(6)
    want, _ = run_spec(model_dir, prompts, params, None, **ENGINE)
    got, stats = run_spec(
        model_dir, prompts, params, {**MTP, "num_speculative_tokens": 4}, **ENGINE
    )
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert stats["spec_drafts"] > 0


@pytest.mark.parametrize("kind", ["deepseek-v3", "qwen3.5"])
def test_handoff_brings_the_mtp_layers_prompt_kv(targets, always_speculate, monkeypatch, kind):
    """A prefill-only engine runs the MTP layer over the prompt (DeepSeek's: its latent KV;
    Qwen3.5's beside the hybrid's recurrent state) and its sink sends that KV on; the decode
    engine's guesses are those of a layer that saw the whole prompt, and its tokens the
    target's."""
    model_dir, hf, tensors = targets(kind)
    check_head_hand_off(model_dir, hf, MTP, tensors, monkeypatch, _prompts(4), True, **ENGINE)


def test_refusals_say_what_to_change(targets, tmp_path):
    model_dir, _, _ = targets("deepseek-v3")
    for bad, words in (
        ({**MTP, "model": "some/other"}, "no 'model'"),
        ({**MTP, "quantization": "int8"}, "no 'quantization'"),
    ):
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)
    assert SpeculativeConfig.parse({**MTP, "model": "self"}).model == "self"
    with pytest.raises(ValueError, match="pipeline_parallel_size 1"):
        LLM(model_dir, speculative_config=MTP, pipeline_parallel_size=2, **ENGINE)
    bare = tmp_path / "bare"  # (V3's config says one MTP layer; its checkpoint has none)
    build_arch_model(bare, "deepseek-v3", num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match=r"carries no MTP layer .*eh_proj.weight absent"):
        LLM(str(bare), speculative_config=MTP, **ENGINE)
    llama = tmp_path / "llama"
    make_tiny_model(llama, "llama-gqa")
    with pytest.raises(ValueError, match="'mtp' is not available for LlamaForCausalLM"):
        LLM(str(llama), speculative_config=MTP, **ENGINE)


def test_a_reader_can_skip_tensors(tmp_path):
    """iter_safetensors(keep=...) reads only the tensors named (an MTP head's few)."""
    make_tiny_model(tmp_path, "llama-gqa")
    every = [n for n, _ in safetensors_io.iter_safetensors(tmp_path)]
    kept = [n for n, _ in safetensors_io.iter_safetensors(tmp_path, lambda n: "layers.1." in n)]
    assert kept == [n for n in every if "layers.1." in n] and 0 < len(kept) < len(every)
