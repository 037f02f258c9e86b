"""Turns one step's logits into one token per sequence.

Pipeline per row: allowed_token_ids -> bad words -> logit_bias -> repetition penalty ->
frequency/presence penalties -> min_tokens masking -> a spent thinking budget's </think>
(engine/thinking.py) -> temperature -> top-k -> top-p -> min-p -> sample (vLLM's order; a
structured-output grammar masks first).
Greedy rows take the argmax after the penalty/masking stage, as in vLLM.

Only the per-request shaping (allowed ids, biases, penalties, which need each
sequence's own parameters or token history) and the per-generator noise draws
loop over rows in Python; every other stage works on
the whole batch with per-row parameter tensors, because this runs on every
decode step. Logprobs are the raw distribution's (before any processing but a structured-output
grammar's mask, as vLLM: engine/structured/grammar.py); a row with top_logprobs gets a TokenLogprob
carrying its k most likely tokens (all of them for vLLM's logprobs=-1), and a row that asked in
vLLM's form (SamplingParams.vllm_logprobs) its sampled token's rank too.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine.forward_context import host_tensor
from pdserve.engine.kernels import fused_for
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.structured.grammar import GrammarMask
    from pdserve.engine.thinking import ThinkingBudget

_U64 = 0xFFFF_FFFF_FFFF_FFFF


class OutputTail(Sequence):
    """A sequence's output tokens as a sampling row reads them: tokens[start:end] of its token
    list, without the copy a slice makes (a copy per row per step adds up over a long output;
    most rows never read it). Its end is fixed when made: later appends are not in it."""

    __slots__ = ("_tokens", "_start", "_end")

    def __init__(self, tokens: list[int], start: int):
        self._tokens, self._start, self._end = tokens, start, len(tokens)

    def __len__(self) -> int:
        return self._end - self._start

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self._end - self._start)
            if step != 1:
                return self._tokens[self._start : self._end][i]
            return self._tokens[self._start + start : self._start + max(start, stop)]
        n = self._end - self._start
        if not -n <= i < n:
            raise IndexError(i)
        return self._tokens[self._start + (i if i >= 0 else n + i)]

    def __iter__(self):
        return itertools.islice(self._tokens, self._start, self._end)


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # The generator is the source of truth for seeding: a row whose params
    # carry a seed but which has no generator samples from the shared stream.
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...] = ()
    # the sequence's thinking budget (engine/thinking.py), and how many of output_token_ids it
    # has committed (those after are a speculated row's guesses)
    thinking: ThinkingBudget | None = None
    committed: int = 0


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float] | None


class TokenLogprob(float):
    """A sampled token's logprob that also carries `top`: {token id: logprob} of the
    SamplingParams.top_logprobs most likely tokens at its position, most likely first (OpenAI's
    top_logprobs), and, where the request asked in vLLM's form, `rank`: the sampled token's rank
    in the vocabulary (1: the most likely; vLLM's count of tokens at least as likely). A float
    everywhere else, so the logprob lists pass through unchanged."""

    top: dict[int, float]
    rank: int | None

    def __new__(cls, value: float, top: dict[int, float], rank: int | None = None):
        obj = super().__new__(cls, value)
        obj.top = top
        obj.rank = rank
        return obj

    def __reduce__(self):
        return (TokenLogprob, (float(self), self.top, self.rank))


class RankedLogprobs(dict):
    """One prompt position's {token id: logprob} (engine/model_runner.py) that also carries
    `rank`: the prompt token's rank in the vocabulary there, as TokenLogprob.rank counts it. A
    dict everywhere else."""

    rank: int | None = None


def _with_top(
    logprobs: list[float], raw: torch.Tensor, rows: list[SamplingRow], picked: torch.Tensor
) -> list[float]:
    """`logprobs` with each row that asks for top_logprobs as a TokenLogprob (its top-k of the
    raw distribution, as the sampled token's logprob is; the whole vocabulary for -1), and each
    row that asked in vLLM's form with its sampled token's rank (`picked`: the sampled tokens'
    raw logits)."""
    want = [i for i, r in enumerate(rows) if r.params.top_logprobs or r.params.vllm_logprobs]
    if not want:
        return logprobs
    vocab = raw.shape[-1]
    counts = [rows[i].params.top_logprobs for i in want]
    k = min(vocab, max(vocab if c == -1 else c for c in counts))
    idx = torch.as_tensor(want, device=raw.device)
    sub = raw[idx]
    top = (sub - torch.logsumexp(sub, dim=-1, keepdim=True)).topk(k, dim=-1)
    ids, values = top.indices.tolist(), top.values.tolist()
    # vLLM's rank: the tokens at least as likely as the sampled one, itself included
    ranks = [None] * len(want)
    if any(rows[i].params.vllm_logprobs for i in want):
        ranks = (sub >= picked[idx].unsqueeze(1)).sum(dim=-1).tolist()
    for j, i in enumerate(want):
        params = rows[i].params
        kk = vocab if params.top_logprobs == -1 else params.top_logprobs
        rank = ranks[j] if params.vllm_logprobs else None
        logprobs[i] = TokenLogprob(logprobs[i], dict(zip(ids[j][:kk], values[j][:kk])), rank)
    return logprobs


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def make_generator(seed: int, child_index: int = 0) -> torch.Generator:
    """CPU generator for a request's seed; n>1 children get distinct but deterministic streams."""
    # Child 0 uses the seed as-is so n=1 behaves like torch.manual_seed(seed);
    # other children hash (seed, index) so neighbouring seeds don't share streams.
    # Masking to 64 bits lets any Python int (negative, huge) be a seed.
    s = seed & _U64
    if child_index:
        s = _splitmix64(s ^ _splitmix64(child_index))
    g = torch.Generator(device="cpu")
    g.manual_seed(s)
    return g


def _min_tokens_masked_ids(row: SamplingRow) -> list[int]:
    p = row.params
    if len(row.output_token_ids) >= p.min_tokens:
        return []
    ids = list(p.stop_token_ids)
    if not p.ignore_eos:
        ids.extend(row.eos_token_ids)
    return ids


def _bad_word_ends(row: SamplingRow) -> list[int]:
    """The last tokens of the bad words whose other tokens are the last ones generated (vLLM's
    rule: a one-token word is banned everywhere)."""
    out, ids = [], row.output_token_ids
    for word in row.params.bad_words_token_ids:
        k = len(word) - 1
        if k <= len(ids) and (k == 0 or tuple(ids[len(ids) - k :]) == word[:k]):
            out.append(word[k])
    return out


def _counts(ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(list(ids), dtype=torch.long, device=device)
    # Ids past the logits' width (tokenizer/model vocab mismatch) cannot be
    # penalized; slicing keeps bincount's output aligned with the logits.
    return torch.bincount(t, minlength=vocab)[:vocab]


def _allow_ban_and_bias(x: torch.Tensor, row: SamplingRow, grammar: bool) -> None:
    """One row's logits, in place: every token outside allowed_token_ids to -inf, the bad words'
    banned tokens too, then logit_bias added. Where a grammar already masked the row and a mask
    would leave it no token, the grammar's choice stands (as it does against min_tokens)."""
    params, (vocab,), device = row.params, x.shape, x.device
    if params.allowed_token_ids:
        idx = torch.as_tensor(
            [t for t in params.allowed_token_ids if t < vocab], dtype=torch.long, device=device
        )
        kept = x[idx].clone()
        if not grammar or torch.isfinite(kept).any():
            x.fill_(float("-inf"))
            x[idx] = kept
    banned = [t for t in _bad_word_ends(row) if t < vocab] if params.bad_words_token_ids else []
    if banned:
        idx = torch.as_tensor(banned, dtype=torch.long, device=device)
        kept = x[idx].clone()
        x[idx] = float("-inf")
        if grammar and not torch.isfinite(x).any():
            x[idx] = kept
    pairs = [(t, b) for t, b in params.logit_bias if t < vocab]
    if pairs:
        ids, biases = zip(*pairs)
        idx = torch.as_tensor(ids, dtype=torch.long, device=device)
        x[idx] += torch.as_tensor(biases, dtype=x.dtype, device=device)


def process_logits(
    logits: torch.Tensor, rows: list[SamplingRow], grammar_rows: Collection[int] = ()
) -> torch.Tensor:
    """allowed_token_ids, bad words and logit_bias, penalties, then min_tokens masking
    (grammar_rows: the rows a grammar masked).

    Returns `logits` itself (no copy) when no row needs any, so the
    all-greedy decode step stays a single argmax; otherwise a modified copy.
    """
    out: torch.Tensor | None = None
    vocab, device = logits.shape[1], logits.device
    for i, row in enumerate(rows):
        p = row.params
        masked = _min_tokens_masked_ids(row) if p.min_tokens else []
        close = row.thinking is not None and row.thinking.forces_close(
            row.output_token_ids, row.committed
        )
        if not p.shapes_logits and not masked and not close:
            continue
        if out is None:
            out = logits.clone()
        x = out[i]
        if p.allowed_token_ids or p.logit_bias or p.bad_words_token_ids:
            _allow_ban_and_bias(x, row, i in grammar_rows)
        if p.repetition_penalty != 1.0:
            seen = _counts([*row.prompt_token_ids, *row.output_token_ids], vocab, device) > 0
            # HF/vLLM: shrink positive logits, push negative ones further down,
            # so a repeated token always becomes less likely.
            penalized = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x.copy_(torch.where(seen, penalized, x))
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            # OpenAI semantics: only generated tokens count, not the prompt.
            counts = _counts(row.output_token_ids, vocab, device)
            x.sub_(
                counts.to(x.dtype) * p.frequency_penalty
                + (counts > 0).to(x.dtype) * p.presence_penalty
            )
        masked = [t for t in masked if 0 <= t < vocab]
        if masked:
            idx = torch.as_tensor(masked, dtype=torch.long, device=device)
            kept = x[idx].clone()
            x[idx] = float("-inf")
            if i in grammar_rows and not torch.isfinite(x).any():
                x[idx] = kept  # the grammar allows only a stop token here: min_tokens yields
        if close:
            _force(x, row.thinking.close_id, i in grammar_rows)
    return logits if out is None else out


def _force(x: torch.Tensor, token: int, grammar: bool) -> None:
    """One row's logits, in place: `token` the only one left (its own logit kept, 0 where a mask
    had removed it), unless a grammar masked the row and does not allow it: the grammar stands."""
    if token >= x.shape[0] or (grammar and not torch.isfinite(x[token])):
        return
    value = x[token].item()
    x.fill_(float("-inf"))
    x[token] = value if value != float("-inf") else 0.0


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """Masks logits outside each row's top-k / nucleus to -inf (returns a new tensor).

    k: long [rows], <= 0 = disabled. p: float [rows], 1.0 = disabled.
    Tokens tied with the k-th logit are all kept, as in vLLM.
    """
    if k is None and p is None:
        return logits
    vocab = logits.shape[1]
    # One ascending sort serves both filters (the vLLM topk_topp_sampler scheme).
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        # Disabled rows use k=vocab: the threshold is the row minimum, masking nothing.
        k = torch.where(k > 0, k.clamp(max=vocab), torch.full_like(k, vocab))
        thresh = logits_sort.gather(1, (vocab - k).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < thresh, float("-inf"))
    if p is not None:
        cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        # Ascending order: a token can go when the mass strictly above it
        # already reaches top_p, i.e. its cumulative (from below) <= 1 - top_p.
        drop = cum <= (1 - p).unsqueeze(1)
        drop[:, -1] = False  # never empty the distribution
        logits_sort.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits_sort).scatter_(1, logits_idx, logits_sort)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zeroes tokens whose prob < min_p * the row's max prob (min_p 0 = disabled)."""
    thresh = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill(probs < thresh, 0.0)


def _exponential_race(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """argmax(probs / Exp(1)) samples from probs (unnormalized is fine).

    Each seeded row draws a full-vocab noise vector from its own generator, so
    its tokens depend only on its seed and its own logits, never on batch
    composition or position.
    """
    num_rows, vocab = probs.shape
    device = probs.device
    q = torch.empty_like(probs)
    seeded = [i for i, r in enumerate(rows) if r.generator is not None]
    if len(seeded) < num_rows:
        if not seeded:
            q.exponential_()
        else:
            unseeded = [i for i, r in enumerate(rows) if r.generator is None]
            idx = torch.as_tensor(unseeded, device=device)
            q[idx] = torch.empty(len(unseeded), vocab, device=device).exponential_()
    if seeded:
        noise = [
            torch.empty(vocab, dtype=probs.dtype, device=rows[i].generator.device).exponential_(
                generator=rows[i].generator
            )
            for i in seeded
        ]
        q[torch.as_tensor(seeded, device=device)] = torch.stack([n.to(device) for n in noise])
    # An Exp(1) draw of exactly 0 would turn a zero-prob token into 0/0 = NaN,
    # which argmax would happily pick.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def skip_sample_draw(generator: torch.Generator, vocab: int) -> None:
    """Advances `generator` past the noise one random (temperature > 0) sampling step draws from
    it in _exponential_race: a sequence whose first token another engine sampled (disaggregated
    serving) then draws its next token from the same point of its stream as in one engine."""
    torch.empty(vocab, dtype=torch.float32, device=generator.device).exponential_(
        generator=generator
    )


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    device = logits.device
    params = [r.params for r in rows]
    temps = host_tensor([sp.temperature for sp in params], logits.dtype, device)
    logits = logits / temps.unsqueeze(1)

    k = p = None
    if any(sp.top_k > 0 for sp in params):
        k = host_tensor([sp.top_k for sp in params], torch.long, device)
    if any(sp.top_p < 1.0 for sp in params):
        p = host_tensor([sp.top_p for sp in params], logits.dtype, device)
    logits = apply_top_k_top_p(logits, k, p)

    probs = logits.softmax(dim=-1)
    if any(sp.min_p > 0.0 for sp in params):
        min_p = host_tensor([sp.min_p for sp in params], probs.dtype, device)
        probs = apply_min_p(probs, min_p)
    return _exponential_race(probs, rows)


def plain_greedy(rows: Sequence[SamplingRow]) -> bool:
    """Whether every row's token is the argmax of its raw logits: greedy, no logprobs, nothing
    that changes the logits first (penalties, biases, min_tokens, a thinking budget closing).
    Such a step can take its tokens on the device (engine/cuda_graphs.py run_greedy)."""
    for row in rows:
        p = row.params
        if not p.greedy or p.wants_logprobs or p.shapes_logits or _min_tokens_masked_ids(row):
            return False
        if row.thinking is not None and row.thinking.forces_close(
            row.output_token_ids, row.committed
        ):
            return False
    return True


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of [rows, vocab] float32 logits, by the compiled kernel on CPU."""
    fused = fused_for(x)
    return fused.argmax_rows(x) if fused is not None and x.stride(-1) == 1 else x.argmax(dim=-1)


class Sampler:
    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], mask: GrammarMask | None = None
    ) -> SampleOutput:
        """One token per row (and logprobs where asked); mask: the step's structured-output
        mask (engine/structured/grammar.py), applied before anything else."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}"
            )
        if logits.dtype != torch.float32:
            logits = logits.float()
        # grammar rows first: everything after, logprobs included, sees the masked logits
        grammar_rows = ()
        if mask is not None:
            logits, grammar_rows = mask.apply(logits), frozenset(mask.rows)
        processed = process_logits(logits, rows, grammar_rows)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_rows:
            tokens = argmax(processed)
        elif len(random_rows) == len(rows):
            tokens = _sample_random(processed, rows)
        else:
            tokens = argmax(processed)
            idx = torch.as_tensor(random_rows, device=logits.device)
            tokens[idx] = _sample_random(processed[idx], [rows[i] for i in random_rows])

        logprobs = None
        if any(r.params.wants_logprobs for r in rows):
            # Raw logprobs: the model's distribution, before any processing.
            picked = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)
            raw = (picked - torch.logsumexp(logits, dim=-1)).tolist()
            logprobs = _with_top(raw, logits, rows, picked)
        return SampleOutput(token_ids=tokens.tolist(), logprobs=logprobs)
