"""LLMEngine.update_weights (a trainer's weight sync): two tiny random checkpoints of the same
shapes, A and B. An engine started on A and updated to B answers as HF's B does, token for
token, at TP 1 and across TP 2's ranks, and back to A as A does; a prompt cached under A is never
served from that cache under B; a checkpoint of other shapes, a missing directory, a running
request and a quantized mode are refused before anything changed, and the engine still answers
as before."""

from __future__ import annotations

import pytest

from helpers.engine import KV, greedy
from helpers.models import hf_greedy, random_prompts
from helpers.threads import assert_no_leaks
from helpers.weights import OTHER_SHAPES, SAME_SHAPES, tiny_checkpoints
from pdserve.engine import LLM
from pdserve.engine.errors import WeightUpdateRefused

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: (model_dir, HF model)}: A and B share every shape, C has one layer more."""
    return tiny_checkpoints(tmp_path_factory, "weights", (*SAME_SHAPES, OTHER_SHAPES))


def _answers(llm, prompts) -> list[list[int]]:
    return [
        o.outputs[0].token_ids for o in llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    ]


def _hf(model, prompts) -> list[list[int]]:
    return [hf_greedy(model, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("tp", [1, 2])
def test_an_update_answers_as_the_new_checkpoint_and_back(checkpoints, tp):
    (a_dir, a_hf), (b_dir, b_hf) = checkpoints["A"], checkpoints["B"]
    prompts = random_prompts([5, 40, 70], seed=3)
    llm = LLM(a_dir, tensor_parallel_size=tp, kv_cache_memory=KV, block_size=16)
    try:
        want_a, want_b = _hf(a_hf, prompts), _hf(b_hf, prompts)
        assert want_a != want_b  # two checkpoints that answer differently
        assert _answers(llm, prompts) == want_a
        llm.engine.update_weights(b_dir)
        assert llm.engine.weights_dir == b_dir
        assert _answers(llm, prompts) == want_b  # the 40- and 70-token prompts were cached
        llm.engine.update_weights(a_dir)
        assert _answers(llm, prompts) == want_a
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


def test_no_block_cached_under_the_old_weights_is_reused(checkpoints):
    (a_dir, _), (b_dir, _) = checkpoints["A"], checkpoints["B"]
    prompt = random_prompts([64], seed=4)[0]
    llm = LLM(a_dir, kv_cache_memory=KV, block_size=16)
    try:
        llm.generate([prompt], greedy(2), use_tqdm=False)
        again = llm.generate([prompt], greedy(2), use_tqdm=False)[0]
        assert again.num_cached_tokens >= 48  # cached under A
        llm.engine.update_weights(b_dir)
        after = llm.generate([prompt], greedy(2), use_tqdm=False)[0]
        assert after.num_cached_tokens == 0
    finally:
        llm.shutdown()


def test_refusals_change_nothing(checkpoints, tmp_path):
    (a_dir, a_hf), (c_dir, _) = checkpoints["A"], checkpoints["C"]
    prompts = random_prompts([9, 30], seed=5)
    llm = LLM(a_dir, kv_cache_memory=KV, block_size=16)
    try:
        with pytest.raises(WeightUpdateRefused, match="num_layers 3 .serving 2") as e:
            llm.engine.update_weights(c_dir)
        assert not e.value.precondition
        with pytest.raises(WeightUpdateRefused, match="not a checkpoint directory"):
            llm.engine.update_weights(str(tmp_path / "nowhere"))
        llm.engine.add_request("running", prompts[0], greedy(MAX_TOKENS))
        with pytest.raises(WeightUpdateRefused, match="pause first") as e:
            llm.engine.update_weights(checkpoints["B"][0])
        assert e.value.precondition
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        assert llm.engine.weights_dir == a_dir
        assert _answers(llm, prompts) == _hf(a_hf, prompts)
    finally:
        llm.shutdown()
    quantized = LLM(a_dir, kv_cache_memory=KV, block_size=16, quantization="int8")
    try:
        with pytest.raises(WeightUpdateRefused, match="quantization=int8") as e:
            quantized.engine.update_weights(checkpoints["B"][0])
        assert e.value.precondition
    finally:
        quantized.shutdown()


@pytest.mark.parametrize("kind", ["gemma2", "phi3", "mixtral", "olmo2", "granite"])
def test_every_family_loads_again_as_hf_answers(tmp_path, kind):
    """Each family's loading (its own checkpoint names and transforms: Gemma's norms, Phi-3's
    fused projections, a mixture's experts, OLMo 2's norms, Granite's multipliers) runs a second
    time into a packed model and answers as HF's second checkpoint does."""
    from helpers.arch import build_arch_model

    first, second = tmp_path / "first", tmp_path / "second"
    hf_first = build_arch_model(first, kind, seed=0, initializer_range=0.1)
    hf = build_arch_model(second, kind, seed=1, initializer_range=0.1)
    prompts = random_prompts([6, 37], seed=7)
    want = _hf(hf, prompts)
    assert want != _hf(hf_first, prompts)
    llm = LLM(str(first), kv_cache_memory=KV, block_size=16, dtype="float32")
    try:
        llm.engine.update_weights(str(second))
        assert _answers(llm, prompts) == want
    finally:
        llm.shutdown()
