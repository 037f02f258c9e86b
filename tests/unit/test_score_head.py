"""The engine's classification head (engine/score_head.py, pooling "classify") on tiny random
models in float32, against HF transformers within 1e-4:

- a *ForSequenceClassification checkpoint of several families gives HF's logits, whether the
  prompt runs whole, in chunks or after a prefix-cache hit; it runs no generation (refused with
  the reason), and its start's warm-up is a classification;
- a generative model with classifier_from_token gives HF's logits of those tokens at the last
  position, Gemma 2's final soft-cap included and from a tied embedding too;
- a model without a head refuses "classify", and classifier_from_token refuses a string that is
  not one token, a token named twice and a classifier checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from helpers.arch import build_arch_model
from helpers.engine import run_until_done
from helpers.models import random_prompts
from pdserve.engine import LLM
from pdserve.engine.errors import InvalidRequest
from pdserve.engine.request import PoolingParams
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
CLASSIFY = PoolingParams("classify")


def _engine(model_dir, **kw):
    return LLM(model_dir, dtype="float32", kv_cache_memory=1 << 20, block_size=4, **kw).engine


def _classify(engine, prompts) -> list[torch.Tensor]:
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", p, None, pooling=CLASSIFY)
    outs = {o.request_id: o for o in run_until_done(engine) if o.finished}
    assert all(o.outputs[0].finish_reason == "pooled" for o in outs.values())
    return [outs[f"c{i}"].pooled for i in range(len(prompts))]


def _hf_logits(hf, ids, tokens=None) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits
    return logits[0] if tokens is None else logits[0, -1, list(tokens)]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2", "qwen2-moe"])
@pytest.mark.parametrize("budget", [512, 8], ids=["whole", "chunked"])
def test_a_classifier_checkpoint_gives_hf_logits(tmp_path, kind, budget):
    hf = build_arch_model(tmp_path, kind, labels=("a", "b", "c"))
    engine = _engine(str(tmp_path), max_num_batched_tokens=budget)
    assert engine.model_config.label_names == ("a", "b", "c")
    prompts = random_prompts([1, 9, 40], seed=4)
    for p, got in zip(prompts, _classify(engine, prompts)):
        assert got.shape == (3,)
        assert (got - _hf_logits(hf, p)).abs().max().item() < TOL
    # again: the prompts' full blocks come from the prefix cache, the logits stay HF's
    engine.add_request("again", prompts[2], None, pooling=CLASSIFY)
    out = [o for o in run_until_done(engine) if o.finished][0]
    assert out.num_cached_tokens == 36
    assert (out.pooled - _hf_logits(hf, prompts[2])).abs().max().item() < TOL
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_classifier_refuses_to_generate_and_warms_up_by_classifying(tmp_path):
    build_arch_model(tmp_path, "llama", labels=("x",))
    engine = _engine(str(tmp_path))
    # the default mode keeps a classifier dense: the precision probe judges an LM head
    auto = LLM(str(tmp_path), kv_cache_memory=1 << 20, block_size=4).engine
    assert auto.config.quantization is None and "classifier checkpoint" in auto.mode_note
    with pytest.raises(InvalidRequest, match="1-label classifier.*does not generate"):
        engine.add_request("g", [5, 6, 7], SamplingParams(max_tokens=2))
    assert engine.warm_up(prompt_len=8) >= 0
    assert engine.scheduler.num_unfinished == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_label_tokens_give_the_lm_logits_of_those_tokens(tmp_path, kind):
    hf = build_arch_model(tmp_path, kind)
    if kind == "gemma2":  # logits past the cap, so a dropped soft-cap changes them
        assert hf.config.final_logit_softcapping
        with torch.no_grad():
            hf.lm_head.weight.mul_(400)
        hf.save_pretrained(tmp_path)
    engine = _engine(str(tmp_path), classifier_from_token=["t9", "t7", "t200"])
    assert engine.model_config.score_token_ids == (9, 7, 200)
    prompts = random_prompts([3, 30], seed=8)
    for p, got in zip(prompts, _classify(engine, prompts)):
        assert (got - _hf_logits(hf, p, (9, 7, 200))).abs().max().item() < TOL * 100
    # the model still generates beside it
    engine.add_request("g", prompts[0], SamplingParams(max_tokens=2, temperature=0))
    assert [o for o in run_until_done(engine) if o.finished][0].outputs[0].token_ids


def test_label_tokens_of_a_tied_model_come_from_its_embedding(tmp_path):
    hf = build_arch_model(tmp_path, "llama", tie_word_embeddings=True)
    engine = _engine(str(tmp_path), classifier_from_token=["t3", "t4"])
    (got,) = _classify(engine, [[5, 9, 13, 2]])
    assert (got - _hf_logits(hf, [5, 9, 13, 2], (3, 4))).abs().max().item() < TOL


def test_classify_needs_a_head_and_label_tokens_must_be_single_tokens(tmp_path):
    build_arch_model(tmp_path / "lm", "llama")
    engine = _engine(str(tmp_path / "lm"))
    with pytest.raises(InvalidRequest, match="no classification head"):
        engine.add_request("c", [5, 6], None, pooling=CLASSIFY)
    with pytest.raises(ValueError, match="'t5 t6' is not one token"):
        _engine(str(tmp_path / "lm"), classifier_from_token=["t5 t6"])
    with pytest.raises(ValueError, match="names one token twice"):
        _engine(str(tmp_path / "lm"), classifier_from_token=["t5", "t5"])
    with pytest.raises(ValueError, match="classifier_from_token must be"):
        _engine(str(tmp_path / "lm"), classifier_from_token="t5")
    build_arch_model(tmp_path / "cls", "llama", labels=("a", "b"))
    with pytest.raises(ValueError, match="own head: leave it unset"):
        _engine(str(tmp_path / "cls"), classifier_from_token=["t5"])


def test_the_offline_pooling_calls_answer_as_hf(tmp_path):
    """LLM.classify, .score and .embed (engine/llm.py), in vLLM's shapes: a two-label classifier
    scores the joined texts by sigmoid(logit[1] - logit[0]); a model without a head scores by
    the cosine similarity of its normalised last-token hidden states."""
    hf = build_arch_model(tmp_path / "cls", "llama", labels=("no", "yes"))
    llm = LLM(str(tmp_path / "cls"), dtype="float32", kv_cache_memory=1 << 20, block_size=4)
    (out,) = llm.classify("t5 t6 t7")
    logits = _hf_logits(hf, [5, 6, 7])
    assert (torch.tensor(out.outputs.probs) - torch.softmax(logits, -1)).abs().max() < TOL
    assert out.outputs.label == ("no", "yes")[int(logits.argmax())]
    scores = llm.score("t40 t41 ", ["t50", "t60 t61"])
    for text, s in zip(["t40 t41 t50", "t40 t41 t60 t61"], scores):
        logits = _hf_logits(hf, [int(w[1:]) for w in text.split()])
        assert abs(s.outputs.score - torch.sigmoid(logits[1] - logits[0]).item()) < TOL
    raw = llm.score("t40 t41 ", "t50", use_activation=False)[0].outputs.score
    assert abs(raw - torch.logit(torch.tensor(scores[0].outputs.score)).item()) < 1e-3
    with pytest.raises(ValueError, match="pair them 1:1, 1:N or N:N"):
        llm.score(["t1", "t2"], ["t3", "t4", "t5"])

    lm = build_arch_model(tmp_path / "lm", "llama")
    llm = LLM(str(tmp_path / "lm"), dtype="float32", kv_cache_memory=1 << 20, block_size=4)

    def hidden(ids):
        with torch.no_grad():
            h = lm.model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(h, dim=-1)

    (emb,) = llm.embed([9, 10, 11])
    assert (torch.tensor(emb.outputs.embedding) - hidden([9, 10, 11])).abs().max() < TOL
    # ("t1" is the tokenizer's end-of-sequence text: no word here starts with it)
    (s,) = llm.score("t9 t20", "t22")
    assert abs(s.outputs.score - float(hidden([9, 20]) @ hidden([22]))) < TOL
    with pytest.raises(InvalidRequest, match="no classification head"):
        llm.classify("t5")
