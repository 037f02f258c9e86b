"""Beam search as vLLM runs it (engine/beam_search.py), checked against references that share no
code with it:

- the algorithm on a fake model of known logprobs: where the beams are wide enough to hold every
  sequence, the answer is the best of all sequences by vLLM's score (a brute-force enumeration);
  one beam with ignore_eos is greedy decoding; vLLM's own rules, worked by hand (an
  end-of-sequence candidate below the beam width still completes; the length penalty counts the
  prompt and not the end-of-sequence token);
- `LLM.beam_search` on tiny random models: with ignore_eos, HF transformers'
  generate(num_beams=..., do_sample=False) with no end-of-sequence token (where vLLM's and HF's
  definitions agree); with the end-of-sequence token, on a model of four tokens, the brute-force
  best of every sequence by HF's own logprobs; each step reuses the prefix cache;
- the HTTP front's use_beam_search (router/openai/beam.py) on a fake router whose model is the
  fake model: choices, usage, finish and stop reasons, logprobs, a stream, a batch, the steps'
  requests, the bounds, a client that leaves, and the fields refused with a 400 naming them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random

import pytest
import torch

from helpers.beams import hf_beam_search
from helpers.http_front import FakeRouter, HangingRouter, Words, front_app
from helpers.models import make_tiny_model, random_prompts
from pdserve.engine import LLM, BeamSearchOutput, BeamSearchParams
from pdserve.engine.beam_search import BeamSearch, get_beam_search_score, run
from pdserve.protos.pdserve.v1 import pdserve_pb2

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 1
TOL = 1e-4


# ---- references ----------------------------------------------------------------------------
def fake_logprobs(ctx, vocab: int) -> list[float]:
    """The fake model: a fixed, tie-free distribution over `vocab` tokens for each context."""
    rng = random.Random(repr(list(ctx)))
    logits = [rng.gauss(0, 1.5) for _ in range(vocab)]
    top = max(logits)
    z = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - z for x in logits]


def vllm_score(prompt_len: int, generated: list[int], cum: float, lp: float) -> float:
    """vLLM's score written out: cum / (prompt + generated tokens, a last EOS not counted) ** lp."""
    length = prompt_len + len(generated) - (1 if generated and generated[-1] == EOS else 0)
    return cum / length**lp


def brute_force(prompt, logprobs_of, vocab: int, steps: int, width: int, lp: float, stop=True):
    """The best `width` of every sequence of at most `steps` new tokens (ended by EOS where `stop`)
    by vLLM's score: [(generated tokens, cumulative logprob)], best first."""
    found = []

    def walk(gen, cum):
        if len(gen) == steps or (stop and gen and gen[-1] == EOS):
            found.append((gen, cum))
            return
        lps = logprobs_of(prompt + gen)
        for t in range(vocab):
            walk(gen + [t], cum + lps[t])

    walk([], 0.0)
    found.sort(key=lambda s: vllm_score(len(prompt), s[0], s[1], lp), reverse=True)
    return found[:width]


def fake_scorer(vocab: int, k: int):
    """The scorer of the fake model: each token list's k most likely tokens."""

    def scorer(owners, tokens):
        out = []
        for ctx in tokens:
            lps = fake_logprobs(ctx, vocab)
            best = sorted(range(vocab), key=lambda t: -lps[t])[:k]
            out.append({t: lps[t] for t in best})
        return out

    return scorer


def searched(prompts, params, scorer):
    searches = [BeamSearch(p, params, EOS) for p in prompts]
    run(searches, scorer)
    return [s.best() for s in searches]


def generated(seq, prompt):
    assert seq.tokens[: len(prompt)] == list(prompt)
    return seq.tokens[len(prompt) :]


def assert_same(got, want, prompt):
    assert [generated(s, prompt) for s in got] == [w[0] for w in want]
    assert max(abs(s.cum_logprob - w[1]) for s, w in zip(got, want)) < TOL


# ---- the algorithm on a fake model -----------------------------------------------------------
@pytest.mark.parametrize("lp", [1.0, 0.0, 2.5, -1.0])
def test_wide_enough_beams_find_the_best_of_every_sequence(lp):
    # four tokens, three steps: nine beams hold every live sequence of two tokens (3 x 3), and
    # 2 x 9 candidates are the whole vocabulary, so nothing is pruned that could win
    prompts = [[2, 3, 0], [3], [0, 0, 2, 3, 3, 2, 0]]
    params = BeamSearchParams(beam_width=9, max_tokens=3, length_penalty=lp)
    for prompt, got in zip(prompts, searched(prompts, params, fake_scorer(4, 18))):
        want = brute_force(prompt, lambda c: fake_logprobs(c, 4), 4, 3, 9, lp)
        assert_same(got, want, prompt)
        for seq, (gen, _) in zip(got, want):
            ended = gen[-1] == EOS
            assert seq.finish_reason == ("stop" if ended else "length")
            assert seq.stop_reason == (EOS if ended else None)
            assert len(seq.logprobs) == len(gen)


def test_ignore_eos_makes_the_end_of_sequence_token_an_ordinary_one():
    prompt = [2, 0]
    params = BeamSearchParams(beam_width=9, max_tokens=3, ignore_eos=True, length_penalty=0.0)
    (got,) = searched([prompt], params, fake_scorer(3, 18))
    want = brute_force(prompt, lambda c: fake_logprobs(c, 3), 3, 3, 9, 0.0, stop=False)
    assert_same(got, want, prompt)
    assert all(len(generated(s, prompt)) == 3 and s.finish_reason == "length" for s in got)


def test_one_beam_without_eos_is_greedy_decoding():
    prompt = [4, 5, 6]
    params = BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True)
    (got,) = searched([prompt], params, fake_scorer(10, 2))
    ctx = list(prompt)
    for _ in range(6):
        lps = fake_logprobs(ctx, 10)
        ctx.append(max(range(10), key=lambda t: lps[t]))
    assert got[0].tokens == ctx


def table_scorer(table):
    def scorer(owners, tokens):
        return [table[tuple(t)] for t in tokens]

    return scorer


def test_an_eos_candidate_below_the_beam_width_still_completes():
    # vLLM's rule (HF keeps only end-of-sequence candidates ranked within the beam width): one
    # beam, EOS second of two candidates; the one live beam then falls below it
    table = {
        (9,): {2: math.log(0.6), EOS: math.log(0.4)},
        (9, 2): {3: math.log(0.5), 4: math.log(0.5)},
    }
    params = BeamSearchParams(beam_width=1, max_tokens=2, length_penalty=0.0)
    (got,) = searched([[9]], params, table_scorer(table))
    assert got[0].tokens == [9, EOS] and got[0].finish_reason == "stop"
    assert abs(got[0].cum_logprob - math.log(0.4)) < 1e-12


@pytest.mark.parametrize("lp, winner", [(1.0, [5, EOS]), (0.0, [5, EOS]), (3.0, [4, 4])])
def test_the_length_penalty_counts_the_prompt_and_not_the_eos_token(lp, winner):
    # prompt of 3; A = [4, 4] (cum -2.0), B = [5, EOS] (cum -1.3). vLLM's lengths: A 5, B 4
    # (1.0: A -0.4, B -0.325; 3.0: A -0.016, B -0.0203); HF's (new tokens only) would rank A
    # first at 1.0 (A -1.0, B -1.3)
    table = {
        (7, 8, 9): {4: -1.0, 5: -1.1},
        (7, 8, 9, 4): {4: -1.0, 6: -5.0},
        (7, 8, 9, 5): {EOS: -0.2, 6: -6.0},
    }
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=lp)
    (got,) = searched([[7, 8, 9]], params, table_scorer(table))
    assert got[0].tokens[3:] == winner
    assert get_beam_search_score([7, 8, 9, 5, EOS], -1.3, EOS, 1.0) == pytest.approx(-1.3 / 4)


def test_a_beam_whose_context_is_full_ends_as_it_is():
    def scorer(owners, tokens):
        return [None if len(t) >= 3 else {4: -0.5, 5: -1.0} for t in tokens]

    params = BeamSearchParams(beam_width=2, max_tokens=5)
    (got,) = searched([[1, 2]], params, scorer)
    assert sorted(s.tokens for s in got) == [[1, 2, 4], [1, 2, 5]]
    assert {s.finish_reason for s in got} == {"length"}


@pytest.mark.parametrize(
    "bad",
    [
        dict(beam_width=0, max_tokens=1),
        dict(beam_width=2, max_tokens=0),
        dict(beam_width=True, max_tokens=1),
        dict(beam_width=2, max_tokens=1, temperature=-1.0),
        dict(beam_width=2, max_tokens=1, length_penalty=float("nan")),
        dict(beam_width=2, max_tokens=1, ignore_eos=1),
    ],
)
def test_bad_params_are_a_value_error(bad):
    with pytest.raises(ValueError):
        BeamSearchParams(**bad)


# ---- LLM.beam_search on tiny random models ---------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("beam-llama")
    hf = make_tiny_model(path, "llama-gqa", seed=3)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=1 << 22, block_size=4, max_model_len=64)
    yield llm, hf
    llm.shutdown()


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """A model of four tokens (EOS is 1), peaked enough that sequences differ clearly."""
    path = tmp_path_factory.mktemp("beam-four")
    hf = make_tiny_model(path, "llama-gqa", vocab_size=4, initializer_range=0.3)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=1 << 20, block_size=4, max_model_len=32)
    yield llm, hf
    llm.shutdown()


def hf_logprobs(hf):
    def of(ctx):
        with torch.inference_mode():
            logits = hf(torch.tensor([list(ctx)])).logits[0, -1].double()
        return torch.log_softmax(logits, -1).tolist()

    return of


def hf_cum(hf, prompt, tokens) -> float:
    """The sum of HF's logprobs of the tokens after the prompt."""
    with torch.inference_mode():
        logits = hf(torch.tensor([list(tokens)])).logits[0].double()
    lps = torch.log_softmax(logits, -1)
    return sum(float(lps[i - 1, tokens[i]]) for i in range(len(prompt), len(tokens)))


@pytest.mark.parametrize(
    "width, lp, early", [(1, 1.0, True), (3, 1.0, True), (3, 0.0, "never"), (4, 2.0, False)]
)
def test_ignore_eos_matches_hf_beam_search(llama, width, lp, early):
    llm, hf = llama
    prompts = random_prompts([3, 11], seed=7) + [[5, 6, 7, 8, 9, 2]]
    new = 5
    params = BeamSearchParams(beam_width=width, max_tokens=new, ignore_eos=True, length_penalty=lp)
    outs = llm.beam_search(
        [{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": prompts[1], "cache_salt": "s"}]
        + [" ".join(f"t{t}" for t in prompts[2])],
        params,
    )
    assert len(outs) == 3 and all(isinstance(o, BeamSearchOutput) for o in outs)
    for prompt, out in zip(prompts, outs):
        ref = hf_beam_search(hf, prompt, width, new, length_penalty=lp, early_stopping=early)
        assert [s.tokens for s in out.sequences] == ref.sequences.tolist()
        for seq in out.sequences:  # the new tokens' logprobs by HF's model, summed
            assert abs(seq.cum_logprob - hf_cum(hf, prompt, seq.tokens)) < TOL
        if width > 1:  # HF's score: that sum over the new tokens' count ** lp
            cums = [float(score) * new**lp for score in ref.sequences_scores]
            assert max(abs(s.cum_logprob - c) for s, c in zip(out.sequences, cums)) < TOL
        for seq in out.sequences:
            assert seq.text == " ".join(f"t{t}" for t in seq.tokens)
            assert seq.finish_reason == "length" and len(seq.logprobs) == new
            # each step's candidates: the 2 x width most likely, the chosen token among them
            for step, token in zip(seq.logprobs, seq.tokens[len(prompt) :]):
                assert len(step) == 2 * width and token in step
                assert step[token].rank <= 2 * width


@pytest.mark.parametrize("lp", [1.0, 0.0, 2.5, -1.0])
def test_with_eos_the_best_of_every_sequence_by_hf_logprobs(four, lp):
    llm, hf = four
    prompts = [[0, 2, 3, 2], [3, 3], [2]]
    params = BeamSearchParams(beam_width=9, max_tokens=3, length_penalty=lp)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        want = brute_force(prompt, hf_logprobs(hf), 4, 3, 9, lp)
        assert_same(out.sequences, want, prompt)
        for seq, (gen, _) in zip(out.sequences, want):
            ended = gen[-1] == EOS
            assert (seq.finish_reason, seq.stop_reason) == (
                ("stop", EOS) if ended else ("length", None)
            )
    # the answers end at EOS and at max_tokens both
    assert {s.finish_reason for o in outs for s in o.sequences} == {"stop", "length"}


def test_a_full_context_ends_the_beams(four):
    llm, hf = four  # max_model_len 32: a 30-token prompt leaves room for 2 tokens
    prompt = [2, 3, 0] * 10
    params = BeamSearchParams(beam_width=9, max_tokens=6, length_penalty=0.5)
    (out,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
    assert_same(out.sequences, brute_force(prompt, hf_logprobs(hf), 4, 2, 9, 0.5), prompt)


def test_each_step_is_one_batch_served_from_the_prefix_cache(llama, monkeypatch):
    llm, _ = llama
    batches = []
    generate = llm.generate

    def recording(prompts, params, **kw):
        outs = generate(prompts, params, **kw)
        batches.append((params, [o.num_cached_tokens for o in outs], outs))
        return outs

    monkeypatch.setattr(llm, "generate", recording)
    prompt = random_prompts([13], seed=9)[0]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    llm.beam_search([{"prompt_token_ids": prompt}], params)
    assert len(batches) == 6 and [len(b[1]) for b in batches] == [1, 3, 3, 3, 3, 3]
    for step, (sp, cached, _) in enumerate(batches):
        assert (sp.max_tokens, sp.logprobs, sp.temperature) == (1, 6, 0.0)
        if step:  # every full block of the beam's tokens but its last token's was cached
            length = len(prompt) + step
            assert all(c >= (length - 1) // 4 * 4 for c in cached), (step, cached)


def test_bad_calls_are_a_value_error(llama):
    llm, _ = llama
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search([[5, 6]], {"beam_width": 2, "max_tokens": 2})
    with pytest.raises(ValueError, match="lora_request"):
        llm.beam_search([[5, 6], [7]], params, lora_request=[None])
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search([[5, 6]], params, concurrency_limit=0)


def test_concurrency_limit_searches_the_prompts_in_groups(llama):
    llm, _ = llama
    prompts = random_prompts([4, 5, 6], seed=12)
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    together = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    grouped = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts], params, concurrency_limit=1
    )
    assert [[s.tokens for s in o.sequences] for o in grouped] == [
        [s.tokens for s in o.sequences] for o in together
    ]


# ---- the HTTP front's use_beam_search on a fake router ---------------------------------------
VOCAB = 4


class Tok(Words):
    eos_token_id = EOS


def served_prompt(gen) -> list[int]:
    """The fake router's prompt ids: token ids as they are, a text's "tN" words, a chat's
    messages as t3 <content> and t2 to open the answer."""
    kind = gen.WhichOneof("input")
    if kind == "token_ids":
        return list(gen.token_ids.ids)
    if kind == "text":
        return [int(w[1:]) for w in gen.text.split()]
    ids = []
    for m in gen.chat.messages:
        ids += [3] + [int(w[1:]) for w in m.content.split()]
    return ids + [2]


def fake_answer(gen) -> list:
    """One token of the fake model, as the router answers a step: the greedy token with the
    `top_logprobs` most likely, the prompt's ids when asked for (a request without beam search
    gets the same one token)."""
    ids = served_prompt(gen)
    lps = fake_logprobs(ids, VOCAB)
    order = sorted(range(VOCAB), key=lambda t: -lps[t])[: max(1, gen.sampling.top_logprobs)]
    delta = pdserve_pb2.TokenDelta(index=0, token_ids=[order[0]], logprobs=[lps[order[0]]])
    if gen.sampling.top_logprobs:
        delta.top_logprobs.add(token_ids=order, logprobs=[lps[t] for t in order])
    if gen.return_prompt_token_ids:
        delta.prompt_token_ids.extend(ids)
    finish = pdserve_pb2.Finish(index=0, finish_reason="stop" if order[0] == EOS else "length")
    finish.usage.prompt_tokens, finish.usage.completion_tokens = len(ids), 1
    finish.usage.cached_prompt_tokens = 1
    finish.weight_version = "w1"
    return [pdserve_pb2.GenerateResponse(delta=delta), pdserve_pb2.GenerateResponse(finish=finish)]


async def send(app, path: str, body: dict, leave_after: float | None = None):
    """(status, headers, body bytes) of one request to the ASGI app; `leave_after`: the client
    disconnects that many seconds after sending its body."""
    data = json.dumps(body).encode()
    given, out, chunks = [False], {}, []

    async def receive():
        if not given[0]:
            given[0] = True
            return {"type": "http.request", "body": data, "more_body": False}
        if leave_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(leave_after)
        return {"type": "http.disconnect"}

    async def sendmsg(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            out["headers"] = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "server": ("test", 80),
        "client": ("test", 1),
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
        ],
    }
    await app(scope, receive, sendmsg)
    return out["status"], out.get("headers", {}), b"".join(chunks)


def post(body: dict, path: str = "/v1/completions", **settings):
    router = FakeRouter(fake_answer)
    app = front_app(router, tokenizer=Tok(), **{"max_model_len": 64, **settings})
    status, _, raw = asyncio.run(send(app, path, body))
    return status, raw, router


def texts(gens) -> list[str]:
    return [" ".join(f"t{t}" for t in g) for g in gens]


def brute(prompt, steps, n, lp=1.0):
    return brute_force(prompt, lambda c: fake_logprobs(c, VOCAB), VOCAB, steps, n, lp)


@pytest.mark.parametrize("lp", [1.0, 0.0, 3.0])
def test_completions_answer_the_best_n_sequences_best_first(lp):
    body = dict(prompt="t2 t3 t0", use_beam_search=True, n=9, max_tokens=3, length_penalty=lp)
    status, raw, router = post({**body, "return_token_ids": True})
    assert status == 200, raw
    doc = json.loads(raw)
    want = brute([2, 3, 0], 3, 9, lp)
    choices = doc["choices"]
    assert [c["index"] for c in choices] == list(range(9))
    # vLLM's: the end-of-sequence token is neither in the tokens nor in the text
    kept = [g[:-1] if g[-1] == EOS else g for g, _ in want]
    assert [c["token_ids"] for c in choices] == kept
    assert [c["text"] for c in choices] == texts(kept)
    assert [c["prompt_token_ids"] for c in choices] == [[2, 3, 0]] * 9
    assert [(c["finish_reason"], c["stop_reason"]) for c in choices] == [
        ("stop", EOS) if g[-1] == EOS else ("length", None) for g, _ in want
    ]
    # vLLM's usage: the prompt once, every choice's tokens
    assert doc["usage"]["prompt_tokens"] == 3
    assert doc["usage"]["completion_tokens"] == sum(len(g) for g in kept)
    assert doc["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
    assert doc["pdserve"]["weight_version"] == "w1"
    # one call, then one per live beam per step: each sends the beam's whole token list
    first, *later = router.gens
    assert first.WhichOneof("input") == "text" and first.return_prompt_token_ids
    assert all(g.WhichOneof("input") == "token_ids" for g in later)
    assert all(g.token_ids.ids[:3] == [2, 3, 0] for g in later)
    assert 1 + 3 + 9 >= len(router.gens) > 3
    for g in router.gens:
        s = g.sampling
        assert (s.max_tokens, s.logprobs, s.top_logprobs, s.n) == (1, True, 18, 0)
        assert (s.top_p, s.top_k, s.repetition_penalty) == (1.0, 0, 1.0)
        assert not s.HasField("temperature")  # the model's default, as vLLM's


def test_include_stop_str_in_output_keeps_the_eos_token():
    body = dict(prompt=[3, 3], use_beam_search=True, n=9, max_tokens=3, temperature=0.0)
    body.update(include_stop_str_in_output=True, return_token_ids=True)
    status, raw, router = post(body)
    assert status == 200, raw
    want = brute([3, 3], 3, 9)
    doc = json.loads(raw)
    assert [c["token_ids"] for c in doc["choices"]] == [g for g, _ in want]
    assert doc["usage"]["completion_tokens"] == sum(len(g) for g, _ in want)
    assert all(g.sampling.temperature == 0.0 for g in router.gens)


def test_logprobs_are_each_tokens_and_its_alternatives():
    body = dict(prompt=[2, 0], use_beam_search=True, n=2, max_tokens=3, ignore_eos=True)
    status, raw, _ = post({**body, "logprobs": 3})
    assert status == 200, raw
    for choice in json.loads(raw)["choices"]:
        lp = choice["logprobs"]
        ids = [int(t[1:]) for t in lp["tokens"]]
        ctx = [2, 0]
        for token, logprob, top in zip(ids, lp["token_logprobs"], lp["top_logprobs"]):
            lps = fake_logprobs(ctx, VOCAB)
            assert abs(logprob - lps[token]) < TOL
            best = sorted(range(VOCAB), key=lambda t: -lps[t])[:3]
            assert {f"t{t}" for t in best} <= set(top)
            ctx.append(token)


def test_a_batch_of_prompts_is_searched_at_once():
    # four beams of two steps hold every sequence of two tokens (4 x 4, ignore_eos)
    body = dict(prompt=[[2, 2], [0, 3, 2]], use_beam_search=True, n=4, max_tokens=2)
    status, raw, _ = post({**body, "ignore_eos": True, "length_penalty": 0.0})
    assert status == 200, raw
    doc = json.loads(raw)
    want = [
        brute_force(p, lambda c: fake_logprobs(c, VOCAB), VOCAB, 2, 4, 0.0, stop=False)
        for p in ([2, 2], [0, 3, 2])
    ]
    assert [c["index"] for c in doc["choices"]] == list(range(8))
    assert [c["text"] for c in doc["choices"]] == texts(g for w in want for g, _ in w)
    assert doc["usage"]["prompt_tokens"] == 5 and doc["usage"]["completion_tokens"] == 16


def test_a_chat_streams_its_choices_once_the_search_ends():
    body = dict(messages=[{"role": "user", "content": "t0"}], use_beam_search=True, n=3)
    body.update(max_tokens=3, stream=True, stream_options={"include_usage": True})
    status, raw, _ = post(body, "/v1/chat/completions")
    assert status == 200, raw
    events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e and e != "data: [DONE]"]
    text = {i: "" for i in range(3)}
    reasons = {}
    for e in events:
        for c in e["choices"]:
            text[c["index"]] += c["delta"].get("content") or ""
            if c["finish_reason"]:
                reasons[c["index"]] = c["finish_reason"]
    want = brute([3, 0, 2], 3, 3)
    kept = [g[:-1] if g[-1] == EOS else g for g, _ in want]
    assert [text[i] for i in range(3)] == texts(kept)
    assert [reasons[i] for i in range(3)] == ["stop" if g[-1] == EOS else "length" for g, _ in want]
    assert events[-1]["usage"]["completion_tokens"] == sum(len(g) for g in kept)
    assert raw.decode().endswith("data: [DONE]\n\n")


def test_a_chat_without_max_tokens_searches_up_to_the_context():
    body = dict(messages=[{"role": "user", "content": "t0"}], use_beam_search=True, n=1)
    status, raw, router = post(
        {**body, "ignore_eos": True}, "/v1/chat/completions", max_model_len=8
    )
    assert status == 200, raw
    # the prompt is 3 tokens: 5 steps fill the context
    assert json.loads(raw)["usage"]["completion_tokens"] == 5 and len(router.gens) == 5


def test_max_tokens_past_the_context_is_a_400_naming_it():
    body = dict(prompt=[2, 2, 2], use_beam_search=True, n=2, max_tokens=6)
    status, raw, _ = post(body, max_model_len=8)
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "max_tokens", err
    assert "at most 5" in err["message"]


REFUSED = [
    ("n", 11),
    ("top_p", 0.5),
    ("top_k", 5),
    ("min_p", 0.1),
    ("repetition_penalty", 1.2),
    ("presence_penalty", 0.5),
    ("frequency_penalty", 0.5),
    ("min_tokens", 2),
    ("stop", ["t1"]),
    ("stop_token_ids", [2]),
    ("logit_bias", {"2": 5}),
    ("allowed_token_ids", [2, 3]),
    ("bad_words", ["t2"]),
    ("response_format", {"type": "json_object"}),
    ("structured_outputs", {"regex": "t2"}),
    ("guided_choice", ["t2"]),
    ("max_repetition_pattern_size", 2),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value", REFUSED, ids=[f for f, _ in REFUSED])
def test_fields_a_beam_search_cannot_apply_are_a_400_naming_them(path, field, value):
    body = {"use_beam_search": True, "n": 2, "max_tokens": 2, field: value}
    if path == "/v1/completions":
        body["prompt"] = "t2"
    else:
        body["messages"] = [{"role": "user", "content": "t2"}]
    status, raw, router = post(body, path)
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == field, err
    assert router.gens == []
    # at their neutral values, or without use_beam_search, they are served
    assert post({**body, "use_beam_search": False}, path)[0] == 200


@pytest.mark.parametrize(
    "extra, field",
    [
        (dict(prompt_logprobs=1), "prompt_logprobs"),
        (dict(suffix="t3"), "suffix"),
        (dict(echo=True, logprobs=1), "echo"),
        (dict(max_tokens=0, echo=True), "max_tokens"),
    ],
)
def test_completion_fields_a_beam_search_cannot_apply(extra, field):
    body = {"prompt": "t2", "use_beam_search": True, "n": 2, "max_tokens": 2, **extra}
    status, raw, _ = post(body)
    assert status == 400 and json.loads(raw)["error"]["param"] == field, raw


def test_a_forced_tool_call_is_refused_and_neutral_values_are_served():
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = dict(messages=[{"role": "user", "content": "t2"}], use_beam_search=True, n=2)
    body.update(max_tokens=2, tools=tools)
    status, raw, _ = post({**body, "tool_choice": "required"}, "/v1/chat/completions")
    assert status == 400 and json.loads(raw)["error"]["param"] == "tool_choice", raw
    neutral = dict(top_p=1.0, top_k=-1, min_p=0.0, stop=[], response_format={"type": "text"})
    assert post({**body, "tool_choice": "auto", **neutral}, "/v1/chat/completions")[0] == 200


def test_a_client_that_leaves_stops_the_search():
    router = HangingRouter()
    app = front_app(router, tokenizer=Tok(), max_model_len=64)
    body = dict(prompt=[[2], [3]], use_beam_search=True, n=2, max_tokens=4)
    status, _, _ = asyncio.run(asyncio.wait_for(send(app, "/v1/completions", body, 0.2), 10))
    assert status == 499
    assert len(router.calls) == 2 and all(c.cancelled for c in router.calls)


def test_a_failed_step_fails_the_request():
    def answer(gen):
        if gen.WhichOneof("input") == "token_ids" and len(gen.token_ids.ids) > 2:
            finish = pdserve_pb2.Finish(index=0, finish_reason="abort", message="paused")
            return [pdserve_pb2.GenerateResponse(finish=finish)]
        return fake_answer(gen)

    router = FakeRouter(answer)
    app = front_app(router, tokenizer=Tok(), max_model_len=64)
    body = dict(prompt=[2, 2], use_beam_search=True, n=2, max_tokens=3)
    status, _, raw = asyncio.run(send(app, "/v1/completions", body))
    assert status == 503, raw


def test_the_steps_are_every_live_beam_and_no_more():
    # eight prompts x n=8 at max_tokens=2: at most 64 + 8 calls, the router's bound on sequences
    body = dict(prompt=[[2, t] for t in itertools.islice(itertools.cycle(range(4)), 8)])
    body.update(use_beam_search=True, n=8, max_tokens=2, ignore_eos=True)
    status, raw, router = post(body)
    assert status == 200, raw
    assert len(router.gens) == 8 + 8 * 4  # four tokens: each prompt's first step has 4 beams
