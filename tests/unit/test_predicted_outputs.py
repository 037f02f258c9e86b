"""Predicted outputs (engine/spec/prediction.py): a request's expected output as the speculator's
guesses. The output must equal the output without a prediction (greedy and seeded), whether the
prediction is right, edited or wrong; the counts of accepted and rejected prediction tokens must
say which; a prediction is bounded and its ids checked like every other id a request sends.
"""

from __future__ import annotations

import random

import pytest

from helpers.engine import KV, greedy
from helpers.models import random_prompts
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.errors import BadSamplingParams
from pdserve.engine.sampling_params import MAX_PREDICTION_TOKENS
from pdserve.engine.spec.gate import SpecGate
from pdserve.engine.spec.prediction import Prediction

pytestmark = pytest.mark.usefixtures("one_thread")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
NEW = 40


@pytest.fixture
def always_speculate(monkeypatch):
    """The gate offers every guess it can (its cost model is tested in test_spec_decode.py)."""
    monkeypatch.setattr(
        SpecGate, "choose", lambda self, base, offers, uses_draft: [o.limit for o in offers]
    )


def _follow(prediction: Prediction, output: list[int], k: int = 3) -> list[int]:
    prompt = [900, 901]
    return prediction.propose(prompt + output, len(prompt), k, 2)


def test_the_cursor_follows_the_output_and_finds_it_again_after_an_edit():
    pred = Prediction([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    assert _follow(pred, [1]) == [2, 3, 4]
    assert _follow(pred, [1, 2, 3]) == [4, 5, 6]
    # the model wrote other tokens (an edit): lost until its last two occur in the prediction
    assert _follow(pred, [1, 2, 3, 50, 51]) == []
    # it went back to the prediction further on: a deletion of 4..6
    assert _follow(pred, [1, 2, 3, 50, 51, 7, 8]) == [9, 10, 11]
    assert _follow(pred, [1, 2, 3, 50, 51, 7, 8, 9, 10, 11, 12]) == []  # used up
    # an output cut back (a stop string) is followed again from its start
    assert _follow(pred, [1, 2]) == [3, 4, 5]


def test_the_search_prefers_what_follows_the_place_last_followed():
    # "5 6" occurs twice: after following up to index 6 the later occurrence is the one
    pred = Prediction([5, 6, 1, 2, 3, 4, 5, 6, 7, 8])
    assert _follow(pred, [5, 6, 1, 2, 3, 4]) == [5, 6, 7]
    assert _follow(pred, [5, 6, 1, 2, 3, 4, 40, 5, 6]) == [7, 8]
    # a first token off the prediction: nothing until two tokens match somewhere
    late = Prediction([10, 11, 12, 13])
    assert _follow(late, [99]) == []
    assert _follow(late, [99, 10, 11]) == [12, 13]


def _run(model_dir, prompts, params, spec=NGRAM):
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=4, speculative_config=spec)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()
    return [o.outputs for o in outs]


def _edited(tokens: list[int], rng: random.Random) -> list[int]:
    """`tokens` with a line rewritten: a stretch replaced by other tokens, one deleted."""
    out = list(tokens)
    out[8:12] = [rng.randrange(256) for _ in range(6)]
    del out[24:28]
    return out


def test_greedy_tokens_equal_without_a_prediction_right_edited_or_wrong(
    tiny_models, always_speculate
):
    model_dir, _ = tiny_models()
    prompts = random_prompts([7, 19, 33], seed=11)
    want = [o[0].token_ids for o in _run(model_dir, prompts, greedy(NEW), None)]
    rng = random.Random(3)
    cases = {
        "right": want,
        "edited": [_edited(w, rng) for w in want],
        # right about the first token only: guessed wrong, then lost (prompt lookup guesses)
        "wrong": [w[:1] + [rng.randrange(256) for _ in range(NEW)] for w in want],
    }
    counts = {}
    for name, predictions in cases.items():
        params = [greedy(NEW, prediction_token_ids=p) for p in predictions]
        outs = [o[0] for o in _run(model_dir, prompts, params)]
        assert [o.token_ids for o in outs] == want, name
        counts[name] = (
            sum(o.accepted_prediction_tokens for o in outs),
            sum(o.rejected_prediction_tokens for o in outs),
        )
    # right: every output token after the first (the prefill's) came from the prediction, up to
    # the one sampled after each step's last guess
    accepted, rejected = counts["right"]
    assert rejected == 0 and accepted >= 3 * (NEW - 1) * 3 // 4, counts
    edited_accepted, edited_rejected = counts["edited"]
    assert edited_rejected > 0 and accepted > edited_accepted > (NEW - 20) * 3 // 2, counts
    assert counts["wrong"][0] < counts["wrong"][1] <= 3 * 4, counts


@pytest.mark.parametrize("runs", [None, 4], ids=["default", "num_prediction_tokens=4"])
def test_a_followed_prediction_s_runs_grow_past_num_speculative_tokens(
    tiny_models, always_speculate, runs
):
    """A prediction the output follows is checked in runs that double while they are kept whole
    (4, 8, then num_prediction_tokens, 16 by default), so guesses are kept at positions past
    num_speculative_tokens; num_prediction_tokens=4 keeps them at 4. The tokens stay the same."""
    model_dir, _ = tiny_models()
    prompts = random_prompts([7, 19], seed=12)
    want = [o[0].token_ids for o in _run(model_dir, prompts, greedy(NEW), None)]
    spec = NGRAM if runs is None else {**NGRAM, "num_prediction_tokens": runs}
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=4, speculative_config=spec)
    try:
        params = [greedy(NEW, prediction_token_ids=w) for w in want]
        outs = llm.generate(prompts, params, use_tqdm=False)
        per_pos = llm.engine.spec_stats()["spec_accepted_per_pos"]
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
    if runs is None:
        assert len(per_pos) == 16 and per_pos[15] > 0, per_pos
    else:
        assert len(per_pos) == 4, per_pos


def test_seeded_sampling_and_n_sequences_are_unchanged(tiny_models, always_speculate):
    """Each position is sampled with the noise its seed gives it, guessed or not; each of n
    sequences follows the prediction on its own."""
    model_dir, _ = tiny_models()
    prompts = random_prompts([9, 21], seed=5)
    base = dict(temperature=0.8, seed=3, n=2, max_tokens=24, ignore_eos=True)
    want = _run(model_dir, prompts, SamplingParams(**base), None)
    predictions = [list(o[1].token_ids) for o in want]  # sequence 1's output for both
    params = [SamplingParams(**base, prediction_token_ids=p) for p in predictions]
    got = _run(model_dir, prompts, params)
    assert [[c.token_ids for c in o] for o in got] == [[c.token_ids for c in o] for o in want]
    for outs in got:  # sequence 1 gets its own output as the prediction, sequence 0 another's
        assert outs[1].rejected_prediction_tokens == 0 and outs[1].accepted_prediction_tokens > 0


def test_without_speculation_a_prediction_changes_nothing_and_counts_nothing(tiny_models):
    model_dir, _ = tiny_models()
    prompt = random_prompts([12], seed=2)[0]
    want = _run(model_dir, [prompt], greedy(16), None)[0][0]
    got = _run(model_dir, [prompt], greedy(16, prediction_token_ids=want.token_ids), None)[0][0]
    assert got.token_ids == want.token_ids
    assert got.accepted_prediction_tokens == got.rejected_prediction_tokens == 0


def test_a_prediction_is_bounded_and_its_ids_checked(tiny_models):
    with pytest.raises(BadSamplingParams, match="prediction_token_ids has 65537 ids"):
        SamplingParams(prediction_token_ids=[1] * (MAX_PREDICTION_TOKENS + 1))
    with pytest.raises(BadSamplingParams, match="only ids >= 0"):
        SamplingParams(prediction_token_ids=[3, -1])
    assert SamplingParams(prediction_token_ids=[4, 5]).prediction_token_ids == (4, 5)
    model_dir, _ = tiny_models()
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=4, speculative_config=NGRAM)
    try:
        with pytest.raises(BadSamplingParams, match="prediction token ids must be below"):
            llm.generate([1, 2, 3], greedy(4, prediction_token_ids=[1, 10**6]), use_tqdm=False)
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


# ---- on the wire: OpenAI's field, the router's tokenizing, every RPC edge's bounds -----------
def test_an_openai_prediction_is_text_or_text_parts_and_nothing_else():
    from pydantic import ValidationError

    from pdserve.router.openai.protocol import ChatCompletionRequest

    def body(prediction):
        return ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "prediction": prediction}
        )

    assert body({"type": "content", "content": "t5 t6"}).prediction.text() == "t5 t6"
    parts = [{"type": "text", "text": "t5 "}, {"type": "text", "text": "t6"}]
    assert body({"type": "content", "content": parts}).prediction.text() == "t5 t6"
    for bad in ({"type": "image", "content": "x"}, {"type": "content"}, "t5", {"content": "x"}):
        with pytest.raises(ValidationError, match="prediction"):
            body(bad)


def test_the_router_tokenizes_a_text_prediction_without_special_tokens(tiny_models):
    import grpc

    from pdserve.engine.tokenizer import load_tokenizer
    from pdserve.protos.convert import sampling_kwargs
    from pdserve.protos.pdserve.v1 import pdserve_pb2
    from pdserve.router.text import BadRequest, PromptEncoder

    model_dir, _ = tiny_models("llama-gqa")
    tok = load_tokenizer(model_dir)
    enc = PromptEncoder(tok, 256)
    try:
        req = pdserve_pb2.GenerateRequest(text="t1 t2", prediction="t5 t6 t7")
        req.sampling.max_tokens = 4
        sampling = enc.with_prediction(req)
        want = tok.encode("t5 t6 t7", add_special_tokens=False)
        assert list(sampling.prediction_token_ids) == want and sampling.max_tokens == 4
        assert not req.sampling.prediction_token_ids  # the client's message is left as it was
        params = SamplingParams(**sampling_kwargs(sampling))
        assert params.prediction_token_ids == tuple(want)
        assert enc.with_prediction(pdserve_pb2.GenerateRequest(text="t1")) == (
            pdserve_pb2.SamplingParams()
        )
        req.sampling.prediction_token_ids.append(5)  # sent both ways
        with pytest.raises(BadRequest, match="not both") as e:
            enc.with_prediction(req)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        huge = pdserve_pb2.GenerateRequest(text="t1", prediction="t5 " * 10_000)
        with pytest.raises(BadRequest, match="the prediction has") as e:
            enc.with_prediction(huge)
        assert e.value.code == grpc.StatusCode.OUT_OF_RANGE
    finally:
        enc.close()


@pytest.mark.parametrize(
    "ids, says",
    [
        ([1] * (MAX_PREDICTION_TOKENS + 1), f"{MAX_PREDICTION_TOKENS + 1} ids; at most"),
        ([1, 1000], "prediction_token_ids token ids must be below the vocabulary size 1000"),
    ],
)
def test_every_rpc_edge_refuses_a_prediction_out_of_bounds(ids, says):
    import grpc

    from pdserve.protos.limits import check_sampling
    from pdserve.protos.pdserve.v1 import pdserve_pb2

    msg = pdserve_pb2.SamplingParams(prediction_token_ids=ids)
    refusal = check_sampling(msg, 4096, 1000)
    assert refusal is not None and refusal.code == grpc.StatusCode.INVALID_ARGUMENT
    assert says in refusal.message
    assert (
        check_sampling(pdserve_pb2.SamplingParams(prediction_token_ids=[1, 999]), 4096, 1000)
        is None
    )


def test_num_prediction_tokens_is_checked_and_kept():
    from pdserve.engine.spec.config import SpeculativeConfig

    cfg = SpeculativeConfig.parse({**NGRAM, "num_prediction_tokens": 8})
    assert cfg.prediction_k == 8 and SpeculativeConfig.parse(cfg.to_dict()) == cfg
    assert SpeculativeConfig.parse(NGRAM).prediction_k == 16
    assert SpeculativeConfig.parse({**NGRAM, "num_speculative_tokens": 16}).prediction_k == 16
    for bad in (0, 17, "8", True):
        with pytest.raises(ValueError, match="num_prediction_tokens"):
            SpeculativeConfig.parse({**NGRAM, "num_prediction_tokens": bad})
    draft = {"model": "self", "quantization": "int4", "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="num_prediction_tokens"):
        SpeculativeConfig.parse({**draft, "num_prediction_tokens": 8})
    assert SpeculativeConfig.parse(draft).prediction_k == 0
