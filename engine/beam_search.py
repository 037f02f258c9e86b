"""Beam search as vLLM runs it (vllm/beam_search.py, LLM.beam_search, its OpenAI server's
beam_search): on top of an engine, never inside it. This module owns the algorithm and vLLM's
shapes of it (BeamSearchParams, BeamSearchSequence, BeamSearchOutput, get_beam_search_score);
it runs no model and knows no engine, so the offline LLM (engine/llm.py LLM.beam_search) and the
HTTP front (router/openai/beam.py) drive the same code.

Each step, every live beam of every prompt asks the driver's scorer for ONE more token: the
scorer returns that position's candidates, {token id: logprob} (vLLM's: the 2 x beam_width most
likely tokens of the raw distribution, and the token the engine sampled with `temperature`), or
None where the beam cannot grow (its context is full). Each candidate is the beam, that token
and the cumulative logprob with the token's added. A candidate ending in the tokenizer's
end-of-sequence token (unless ignore_eos) is complete; the others, best cumulative logprob
first, keep the best beam_width as the next step's beams. After max_tokens steps, or once no beam
is live, the complete and the live sequences are sorted by get_beam_search_score (cumulative
logprob / length ** length_penalty, the prompt counted, the end-of-sequence token not) and the
best beam_width are the answer, best first. A sequence's tokens are its prompt's and its own
(its end-of-sequence token included); the driver makes its text. No state outlives a search.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# A step's answer for one token list: {token id: logprob} of its candidates, or None where the
# sequence cannot take another token (its context is full)
Candidates = Mapping[int, float] | None


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: beam_width beams (the answer's sequences), at most max_tokens
    new tokens each; ignore_eos: the end-of-sequence token ends nothing; temperature: the
    engine's sampled token, a candidate besides the most likely ones (0: greedy, so it is one of
    them); length_penalty: the exponent of the length in get_beam_search_score;
    include_stop_str_in_output: the HTTP answer's tokens and text keep the end-of-sequence
    token (the offline tokens always hold it, as vLLM's do)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")


@dataclass
class BeamSearchSequence:
    """One sequence of a search (vLLM's fields): `tokens` the prompt's and the generated ones,
    `logprobs` one {token id: logprob} per generated token (the candidates of its step),
    `cum_logprob` the sum of the generated tokens' logprobs; `text`, `finish_reason` ("stop":
    the end-of-sequence token, `stop_reason` its id; "length": max_tokens or the context) and
    `stop_reason` are set on the sequences a search answers with."""

    tokens: list[int]
    logprobs: list[Mapping[int, float]] = field(default_factory=list)
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's answer: its best sequences (at most beam_width), best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: Sequence[int],
    cumulative_logprob: float,
    eos_token_id: int | None,
    length_penalty: float = 1.0,
) -> float:
    """vLLM's (after HF transformers' BeamHypotheses): the cumulative logprob over the sequence's
    length (prompt included, a last end-of-sequence token not) to the power length_penalty."""
    seq_len = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (max(seq_len, 1) ** length_penalty)


def create_sort_beams_key_function(eos_token_id: int | None, length_penalty: float):
    """vLLM's key of a BeamSearchSequence for sorting by get_beam_search_score."""

    def sort_beams_key(x: BeamSearchSequence) -> float:
        return get_beam_search_score(x.tokens, x.cum_logprob, eos_token_id, length_penalty)

    return sort_beams_key


class BeamSearch:
    """One prompt's search, stepped by a driver: `pending()` gives the live beams' token lists,
    `advance(results)` takes the scorer's answer for each (in that order), until `done`; then
    `best()` gives the answer. `context` is the driver's own (a LoRA request, a cache salt)."""

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        params: BeamSearchParams,
        eos_token_id: int | None,
        *,
        lora_request: Any = None,
        context: Any = None,
    ):
        if not prompt_token_ids:
            raise ValueError("a beam search needs a prompt of at least one token")
        self.params, self.eos_token_id, self.context = params, eos_token_id, context
        self.prompt_len = len(prompt_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_token_ids), lora_request=lora_request)]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens

    def pending(self) -> list[list[int]]:
        return [] if self.done else [b.tokens for b in self.beams]

    def advance(self, results: Sequence[Candidates], records: Sequence | None = None) -> None:
        """One step: results[i] the candidates of beam i (None: it cannot grow and ends as it
        is, "length"); records[i], where given, is what the new sequences keep in `logprobs` for
        this step (None, or records None: the candidates themselves)."""
        if len(results) != len(self.beams):
            raise ValueError(f"{len(results)} results for {len(self.beams)} beams")
        eos, ignore_eos = self.eos_token_id, self.params.ignore_eos
        candidates: list[BeamSearchSequence] = []
        for i, (beam, found) in enumerate(zip(self.beams, results)):
            if found is None:
                beam.finish_reason = "length"
                self.completed.append(beam)
                continue
            kept = found if records is None or records[i] is None else records[i]
            for token_id, logprob in found.items():
                new = BeamSearchSequence(
                    beam.tokens + [int(token_id)],
                    beam.logprobs + [kept],
                    beam.lora_request,
                    beam.cum_logprob + float(logprob),
                )
                if token_id == eos and not ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", eos
                    self.completed.append(new)
                else:
                    candidates.append(new)
        # the best cumulative logprob first (every live beam has the same length); stable, so
        # ties keep the beams' order and each beam's candidates' (the engine's: by rank)
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
        self.beams = candidates[: self.params.beam_width]
        self.steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The best beam_width of the complete and the live sequences, best first; a live one
        ends "length"."""
        for beam in self.beams:
            beam.finish_reason = beam.finish_reason or "length"
        key = create_sort_beams_key_function(self.eos_token_id, self.params.length_penalty)
        every = sorted(self.completed + self.beams, key=key, reverse=True)
        return every[: self.params.beam_width]


def _batch(searches: Sequence[BeamSearch]) -> tuple[list[BeamSearch], list[list[int]], list]:
    """Every live beam of `searches` as one batch: (the searches that step, each beam's owner,
    each beam's tokens)."""
    stepping = [s for s in searches if not s.done]
    owners, tokens = [], []
    for s in stepping:
        for t in s.pending():
            owners.append(s)
            tokens.append(t)
    return stepping, owners, tokens


def _deal(stepping: list[BeamSearch], results: Sequence) -> None:
    """Each search's share of a batch's results (a result: Candidates, or a (Candidates,
    record) pair)."""
    total = sum(len(s.beams) for s in stepping)
    if len(results) != total:
        raise ValueError(f"the scorer answered {len(results)} token lists of {total}")
    at = 0
    for s in stepping:
        mine = results[at : at + len(s.beams)]
        at += len(s.beams)
        pairs = [r if isinstance(r, tuple) else (r, None) for r in mine]
        s.advance([c for c, _ in pairs], [r for _, r in pairs])


Scorer = Callable[[list[BeamSearch], list[list[int]]], Sequence]


def run(searches: Sequence[BeamSearch], scorer: Scorer, on_step=None) -> None:
    """Steps every search to its end, each step's beams of all of them as one batch:
    scorer(owners, token_lists) gives, per token list, its Candidates, or a (Candidates,
    record) pair (BeamSearch.advance). on_step(), where given, after each step."""
    while True:
        stepping, owners, tokens = _batch(searches)
        if not stepping:
            return
        _deal(stepping, scorer(owners, tokens))
        if on_step is not None:
            on_step()


async def run_async(
    searches: Sequence[BeamSearch], scorer: Callable[..., Awaitable[Sequence]]
) -> None:
    """`run` with a coroutine scorer (the HTTP front's calls to the router)."""
    while True:
        stepping, owners, tokens = _batch(searches)
        if not stepping:
            return
        _deal(stepping, await scorer(owners, tokens))
