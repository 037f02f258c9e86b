import dataclasses
import math

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from pdserve.engine.sampler import (
    Sampler,
    SamplingRow,
    apply_top_k_top_p,
    make_generator,
    process_logits,
)
from pdserve.engine.sampling_params import SamplingParams

sampler = Sampler()


def row(params=None, prompt=(), output=(), generator=None, eos=()):
    params = params or SamplingParams()
    if generator is None and params.seed is not None:
        generator = make_generator(params.seed)
    return SamplingRow(params, list(prompt), list(output), generator, tuple(eos))


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(n=1.5), "n"),
        (dict(n=True), "n"),
        (dict(temperature=-1), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(seed=1.5), "seed"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(presence_penalty=-2.5), "presence_penalty"),
        (dict(frequency_penalty=3), "frequency_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens="3"), "max_tokens"),
        (dict(max_tokens=False), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(stop=""), "stop"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop=[1]), "stop"),
        (dict(stop=5), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=[1.0]), "stop_token_ids"),
        (dict(ignore_eos=1), "ignore_eos"),
        (dict(logprobs="yes"), "logprobs"),
    ],
)
def test_validation_error_names_field(kwargs, field):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    msg = str(exc.value)
    assert msg.startswith(field + " "), msg
    value = kwargs[field]
    if not (isinstance(value, float) and math.isnan(value)) and not isinstance(value, list):
        assert repr(value) in msg or str(value) in msg, msg


def test_range_message_shows_allowed_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1\.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\], got 1\.5"):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError, match=r"frequency_penalty must be in \[-2, 2\]"):
        SamplingParams(frequency_penalty=2.5)


def test_defaults_and_normalization():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, (), ())
    assert not p.greedy and not p.has_penalties and p.skip_special_tokens
    q = SamplingParams(temperature=0, stop="END", stop_token_ids=[3, 4], top_k=-1)
    assert q.greedy and q.temperature == 0.0 and isinstance(q.temperature, float)
    assert q.stop == ("END",) and q.stop_token_ids == (3, 4)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert hash(q) == hash(
        SamplingParams(temperature=0.0, stop=("END",), stop_token_ids=(3, 4), top_k=-1)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.top_k = 3  # frozen


# ---------------------------------------------------------------- greedy-equivalents


def _rand_logits(rows, vocab, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax_and_logits_untouched():
    logits = _rand_logits(16, 100)
    before = logits.clone()
    out = sampler(logits, [row(SamplingParams(temperature=0)) for _ in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=1.0),
        SamplingParams(top_k=1, temperature=5.0),
    ],
    ids=["top_k=1", "top_p_tiny", "min_p=1", "top_k=1_hot"],
)
def test_filters_that_reduce_to_greedy(params):
    # Flat-ish logits over 100 tokens: unfiltered sampling would miss argmax often.
    torch.manual_seed(0)
    logits = _rand_logits(64, 100, seed=1) * 0.5
    out = sampler(logits, [row(params) for _ in range(64)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_stay_argmax():
    torch.manual_seed(0)
    logits = _rand_logits(8, 50) * 0.1
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams() for i in range(8)]
    out = sampler(logits, [row(p) for p in params])
    argmax = logits.argmax(-1).tolist()
    assert all(out.token_ids[i] == argmax[i] for i in range(1, 8, 2))
    assert any(out.token_ids[i] != argmax[i] for i in range(0, 8, 2))


# ---------------------------------------------------------------- seeding


def _generate(seed, position, batch_size, steps=20, vocab=50):
    """Runs `steps` decode steps for a seeded row at `position` among random rows."""
    torch.manual_seed(1234 + position + batch_size)  # unseeded neighbours vary
    target = row(SamplingParams(seed=seed, top_p=0.95, top_k=40), prompt=[1, 2])
    others = [
        row(SamplingParams(seed=999 + j) if j % 2 else SamplingParams(temperature=0.8))
        for j in range(batch_size - 1)
    ]
    rows = others[:position] + [target] + others[position:]
    logit_gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        step_logits = torch.randn(vocab, generator=logit_gen) * 0.5  # same per step
        logits = torch.randn(len(rows), vocab)
        logits[position] = step_logits
        out = sampler(logits, rows)
        for r, t in zip(rows, out.token_ids):
            r.output_token_ids.append(t)
    return list(target.output_token_ids)


def test_seed_is_batch_independent():
    alone = _generate(seed=42, position=0, batch_size=1)
    assert alone == _generate(seed=42, position=2, batch_size=5)
    assert alone == _generate(seed=42, position=4, batch_size=5)
    assert alone != _generate(seed=43, position=0, batch_size=1)


def test_make_generator_children_distinct_and_deterministic():
    draw = lambda g: torch.rand(8, generator=g)  # noqa: E731
    assert torch.equal(draw(make_generator(5, 1)), draw(make_generator(5, 1)))
    assert not torch.equal(draw(make_generator(5, 0)), draw(make_generator(5, 1)))
    assert not torch.equal(draw(make_generator(5, 1)), draw(make_generator(5, 2)))
    make_generator(-3)  # any Python int is a usable seed
    make_generator(2**70)


# ---------------------------------------------------------------- distributions

BASE = torch.tensor([1.0, 0.5, 0.0, -1.0])
N = 4000


def _freqs(params_list):
    torch.manual_seed(0)
    out = sampler(BASE.repeat(len(params_list), 1), [row(p) for p in params_list])
    return torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / len(params_list)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.0])
@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_frequencies_match_softmax(temperature, seeded):
    params = [SamplingParams(temperature=temperature, seed=i if seeded else None) for i in range(N)]
    expected = torch.softmax(BASE / temperature, -1)
    assert torch.allclose(_freqs(params), expected, atol=0.03)


def test_top_k_restricts_to_top_two():
    f = _freqs([SamplingParams(top_k=2, temperature=2.0)] * N)
    assert f[2] == 0 and f[3] == 0
    expected = torch.softmax(BASE[:2] / 2.0, -1)
    assert torch.allclose(f[:2], expected, atol=0.03)


def test_top_p_samples_only_nucleus():
    # softmax(BASE) = [.48, .29, .18, .06]: 0.5 needs the top two tokens.
    f = _freqs([SamplingParams(top_p=0.5)] * N)
    assert f[2] == 0 and f[3] == 0
    assert torch.allclose(f[:2], torch.softmax(BASE[:2], -1), atol=0.03)


def test_min_p_drops_unlikely_tokens():
    # prob ratios to the max: [1, .61, .37, .14]; min_p=0.3 drops only token 3.
    f = _freqs([SamplingParams(min_p=0.3)] * N)
    assert f[3] == 0 and f[2] > 0
    assert torch.allclose(f[:3], torch.softmax(BASE[:3], -1), atol=0.03)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(-50, 50), min_size=2, max_size=12, unique=True),
    st.floats(0.05, 1.0),
    st.integers(-1, 14),
)
def test_top_k_top_p_match_reference(values, top_p, top_k):
    logits = torch.tensor([values], dtype=torch.float32) / 10
    order = sorted(range(len(values)), key=lambda i: -values[i])
    survivors = order[:top_k] if top_k > 0 else order
    cum = torch.softmax(logits[0, survivors], -1).cumsum(0).tolist()
    assume(all(abs(c - top_p) > 1e-4 for c in cum))  # float ties at the boundary
    size = next((j + 1 for j, c in enumerate(cum) if c >= top_p), len(cum))
    out = apply_top_k_top_p(logits, torch.tensor([top_k]), torch.tensor([top_p]))
    kept = torch.isfinite(out[0])
    assert set(kept.nonzero().flatten().tolist()) == set(survivors[:size])
    assert torch.equal(out[0][kept], logits[0][kept])


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    r = row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    out = process_logits(logits, [r])
    assert torch.allclose(out, torch.tensor([[1.0, -4.0, 1.0, -1.0, 0.5]]))
    assert logits[0, 0] == 2.0  # caller's tensor untouched


def test_repetition_penalty_changes_greedy_pick():
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    pos = torch.tensor([[2.0, 1.5, 0.0]])
    assert sampler(pos, [row(p)]).token_ids == [0]
    assert sampler(pos, [row(p, output=[0])]).token_ids == [1]
    assert sampler(pos, [row(p, prompt=[0])]).token_ids == [1]  # prompt counts too
    neg = torch.tensor([[-1.0, -1.5, -9.0]])
    assert sampler(neg, [row(p, output=[0])]).token_ids == [1]


def test_frequency_scales_with_count_presence_is_flat():
    logits = torch.zeros(1, 4)
    out = [0, 0, 0, 1]
    freq = process_logits(logits, [row(SamplingParams(frequency_penalty=0.5), output=out)])
    assert torch.allclose(freq, torch.tensor([[-1.5, -0.5, 0.0, 0.0]]))
    pres = process_logits(logits, [row(SamplingParams(presence_penalty=0.5), output=out)])
    assert torch.allclose(pres, torch.tensor([[-0.5, -0.5, 0.0, 0.0]]))
    # OpenAI semantics: prompt tokens are not penalized.
    prompt_only = process_logits(
        logits, [row(SamplingParams(frequency_penalty=1.0, presence_penalty=1.0), prompt=[2])]
    )
    assert torch.equal(prompt_only, logits)
    # Negative penalties encourage repetition.
    enc = process_logits(logits, [row(SamplingParams(presence_penalty=-1.0), output=[3])])
    assert enc[0, 3] == 1.0


def test_frequency_vs_presence_greedy_picks():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    out = [0, 0, 0, 1]  # token 0 x3, token 1 x1
    f = SamplingParams(temperature=0, frequency_penalty=0.6)  # 3-1.8=1.2 < 2-0.6=1.4
    p = SamplingParams(temperature=0, presence_penalty=0.6)  # 2.4 > 1.4
    rows = [row(f, output=out), row(p, output=out)]
    assert sampler(logits.repeat(2, 1), rows).token_ids == [1, 0]


def test_no_penalty_returns_same_tensor():
    logits = torch.zeros(2, 4)
    assert process_logits(logits, [row(), row(SamplingParams(min_tokens=1))]) is logits


# ---------------------------------------------------------------- min_tokens / eos


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]])  # eos=2, stop id=3
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    assert sampler(logits, [row(p, output=[1], eos=[2])]).token_ids == [1]
    assert sampler(logits, [row(p, output=[1, 1], eos=[2])]).token_ids == [2]
    # Random rows are masked too: eos/stop never drawn before min_tokens.
    torch.manual_seed(0)
    ps = SamplingParams(min_tokens=2, stop_token_ids=[3])
    toks = sampler(logits.repeat(500, 1), [row(ps, eos=[2]) for _ in range(500)]).token_ids
    assert set(toks) <= {0, 1}


def test_ignore_eos_leaves_eos_but_masks_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 5.0, 6.0]])
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[3], ignore_eos=True)
    assert sampler(logits, [row(p, eos=[2])]).token_ids == [2]


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(0)
    logits = _rand_logits(6, 30, seed=3)
    params = [
        SamplingParams(logprobs=True, temperature=0.5, top_k=5, repetition_penalty=1.5),
        SamplingParams(logprobs=True, temperature=0, frequency_penalty=1.0),
        SamplingParams(logprobs=False),
        SamplingParams(logprobs=True, top_p=0.3, seed=3),
        SamplingParams(logprobs=True, min_p=0.2, min_tokens=4),
        SamplingParams(logprobs=True, temperature=2.0, presence_penalty=2.0),
    ]
    rows = [row(p, prompt=[1, 2, 3], output=[0, 4, 4], eos=[5]) for p in params]
    out = sampler(logits, rows)
    ref = torch.log_softmax(logits, -1)
    for i, (p, t) in enumerate(zip(params, out.token_ids)):
        if p.logprobs:
            assert out.logprobs[i] == pytest.approx(ref[i, t].item(), abs=1e-5)
    # Penalties shifted the processed distribution, so raw differs from processed.
    proc = torch.log_softmax(process_logits(logits, rows), -1)
    t1 = out.token_ids[1]
    assert abs(proc[1, t1].item() - out.logprobs[1]) > 1e-3


def test_bad_logits_shape_rejected():
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.zeros(2, 4), [row()])


def test_output_tail_reads_as_the_slice_it_replaces():
    """OutputTail (a sampling row's output tokens, not copied) answers len, indexing, slicing and
    iteration as tokens[start:] did when it was made, whatever is appended after."""
    import random

    from pdserve.engine.sampler import OutputTail

    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(0, 9)
        start = rng.randint(0, n)
        tokens = list(range(100, 100 + n))
        tail, want = OutputTail(tokens, start), tokens[start:]
        tokens.append(7)  # (the step's sample, appended after the row was read)
        assert len(tail) == len(want) and list(tail) == want and [*tail] == want
        for i in range(-len(want) - 2, len(want) + 2):
            if -len(want) <= i < len(want):
                assert tail[i] == want[i]
            else:
                with pytest.raises(IndexError):
                    tail[i]
        for a in (None, -7, -2, 0, 1, 3, 8):
            for b in (None, -7, -1, 0, 2, 5, 9):
                for step in (None, 1, 2, -1):
                    assert tail[a:b:step] == want[a:b:step]
