"""Structured output in the engine: compiled grammars, one matcher per sequence, the step's mask.

An LLMEngine holds one GrammarCache (built with the engine, its tokenizer info made on first
use). At admission (`_new_request`, reserve included) `attach` compiles the request's
StructuredSpec (engine/structured/spec.py) once per canonical spec (a bounded LRU; a compile
error becomes the request's BadSamplingParams naming the field) and gives each of its n
sequences a SeqGrammar of its own. Once per step, on the one step thread, the engine asks for
the step's GrammarMask (`step_mask`: every grammar row's next-token bitmask), and the sampler
sets the logits of disallowed tokens to -inf before anything else (`GrammarMask.apply`), so
logprobs are those of the masked distribution, as in vLLM, and greedy and random sampling both
pick an allowed token. The scheduler's `_append_token` then advances the
sequence's matcher by the token (`SeqGrammar.accept`), wherever the token came from: a step,
or a commit of the first token another engine sampled with the same grammar; once the grammar
is complete (the stop token accepted) the sequence finishes. A preempted sequence keeps its
tokens and so its matcher: recompute does not re-append tokens. A spec's `reasoning` (a reasoning
model's chat: the router sets it) puts the grammar after a free reasoning block (`reasoned`).
Library: llguidance
(docs/experiments/structured-output-library.md: the pick and its measurements).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.errors import BadSamplingParams
from pdserve.engine.structured.spec import StructuredSpec
from pdserve.engine.tokenizer import reasoning_tags

MAX_CACHED_GRAMMARS = 256
_NEG_INF = torch.tensor(float("-inf"))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[rows[j], t] = -inf where bit t of bitmask[j] (int32 words, bit t % 32 of
    word t // 32, xgrammar's and llguidance's layout) is 0. Tokens past the bitmask are masked.
    numpy's unpackbits and one torch.where: the fastest of the ways measured on this CPU
    (experiments/structured_mask_cost.py)."""
    vocab = logits.shape[1]
    words = bitmask[: len(rows)].contiguous().numpy().view(np.uint8)
    allowed = torch.from_numpy(np.unpackbits(words, axis=-1, bitorder="little")).view(torch.bool)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    allowed = allowed[:, :vocab].to(logits.device, non_blocking=True)
    neg = _NEG_INF if logits.device.type == "cpu" else _NEG_INF.to(logits.device)
    if rows == list(range(logits.shape[0])) and logits.is_contiguous():
        torch.where(allowed, logits, neg, out=logits)
    else:
        idx = torch.as_tensor(rows, dtype=torch.long, device=logits.device)
        logits[idx] = torch.where(allowed, logits[idx], neg)


class SeqGrammar:
    """One sequence's matcher (an llguidance LLMatcher, copied from its spec's compiled one)."""

    __slots__ = ("matcher", "rejected", "owner")

    def __init__(self, matcher, owner=None):
        self.matcher = matcher
        self.rejected = False
        self.owner = owner  # the GrammarCache that counts the mask's cost

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Row `index` of `bitmask` (int32, contiguous, on the CPU: GrammarCache.step_mask's) gets
        the matcher's next-token mask. What llguidance.torch's fill_next_token_bitmask does, called
        directly: that module compiles a function with torch.compile as it is imported, and the
        import of torch's inductor that brings is slow, paid by a worker's first structured
        request inside its Reserve or Prefill call."""
        row = bitmask[index]
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token_id: int) -> bool:
        """Advances by `token_id`; True when the sequence must end here: the grammar is complete
        (its stop token taken), or the token breaks it (`rejected`: only a first token sampled
        without the grammar)."""
        if not self.matcher.consume_token(token_id):
            self.rejected = True
            return True
        return self.matcher.is_stopped()


class GrammarCache:
    """Compiled grammars of one tokenizer, by canonical spec; thread-safe, so a server may compile
    off the step thread (`compile`) before the request is added. A compiled grammar is a fresh
    LLMatcher that was checked; each sequence takes a copy of it (deep_copy: microseconds)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tags = reasoning_tags(tokenizer)  # <think>, </think>: a spec's reasoning
        self._lltok = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.compile_s = 0.0  # seconds spent compiling (cold), for the benchmarks
        self.hits = self.misses = 0
        self.mask_s = 0.0  # seconds spent masking logits rows (step thread), and how many rows
        self.mask_rows = 0

    def _tokenizer_info(self):
        with self._lock:
            if self._lltok is None:
                import llguidance.hf  # here, not on the step thread

                self._lltok = llguidance.hf.from_tokenizer(
                    self._tokenizer, n_vocab=self._vocab_size, eos_token=self._eos or None
                )
            return self._lltok

    def compile(self, spec: StructuredSpec):
        """The compiled grammar of `spec`, from the cache or compiled now (outside the lock, so a
        step that only looks up never waits on another thread's compile)."""
        key = (*spec.key, spec.reasoning)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        lltok = self._tokenizer_info()
        t0 = time.perf_counter()
        compiled = _compile(lltok, spec, self._tags, self._eos)
        with self._lock:
            self.compile_s += time.perf_counter() - t0
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredSpec) -> SeqGrammar:
        return SeqGrammar(self.compile(spec).deep_copy(), self)

    def stats(self) -> dict[str, int]:
        """WorkerStats' structured-output counters."""
        return {
            "structured_rows": self.mask_rows,
            "structured_mask_ns": int(self.mask_s * 1e9),
            "grammar_compiles": self.misses,
            "grammar_compile_ns": int(self.compile_s * 1e9),
        }

    def step_mask(self, row_seqs) -> GrammarMask | None:
        """The step's mask: the next-token bitmask of each sampling row (row_seqs: the sequence
        each row samples for) whose sequence has a grammar; None when none has."""
        want = [i for i, seq in enumerate(row_seqs) if seq.grammar is not None]
        if not want:
            return None
        t0 = time.perf_counter()
        bitmask = torch.full((len(want), (self._vocab_size + 31) // 32), -1, dtype=torch.int32)
        for j, i in enumerate(want):
            row_seqs[i].grammar.fill(bitmask, j)
        self.mask_s += time.perf_counter() - t0
        self.mask_rows += len(want)
        return GrammarMask(bitmask, want, self)

    def attach(self, seqs) -> None:
        """Each sequence of a request with params.structured gets its own matcher."""
        spec = seqs[0].params.structured if seqs else None
        if spec is None:
            return
        for seq in seqs:
            seq.grammar = self.matcher(spec)


def grammar_text(spec: StructuredSpec, tags=None, eos=()) -> str:
    """llguidance's grammar for `spec`: JSON with no free whitespace (the compact separators
    ", " and ": "), so a model cannot pad its output with whitespace until max_tokens; with
    spec.reasoning, after the reasoning (`reasoned`; `tags`: the ids of <think> and </think>,
    `eos`: the stop tokens, never inside the reasoning)."""
    answer = _answer_text(spec)
    if spec.reasoning in ("", "none"):
        return answer
    if tags is None:
        raise BadSamplingParams(
            "structured.reasoning needs a reasoning model: this one has no <think> and </think> "
            "tokens"
        )
    return reasoned(answer, spec.reasoning, tags, eos)


def reasoned(answer: str, reasoning: str, tags: tuple[int, int], eos=()) -> str:
    """The grammar `answer` (llguidance's JSON or Lark text) after a reasoning model's reasoning:
    any tokens but </think> and the stop tokens, then </think> and at most 4 characters of
    whitespace, then the answer
    ("open": from the first token, the prompt having opened the block; "optional": that block
    opened by <think>, or none), as vLLM holds a grammar only after the reasoning."""
    top = json.loads(answer) if answer.lstrip().startswith("{") else None
    if top is None:
        top = {"grammars": [{"name": "answer", "lark_grammar": answer}]}
    start = top["grammars"][0]["name"]
    opened, closed = tags
    free = ",".join(str(t) for t in (closed, *eos))
    block = f"<[^{free}]>* <[{closed}]> GAP"
    first = block if reasoning == "open" else f"(<[{opened}]> {block})?"
    # GAP: the whitespace models put after </think> ("\n\n"), bounded so none can pad with it
    lark = f"start: {first} @{start}\nGAP: /[ \\t\\r\\n]{{0,4}}/\n"
    top["grammars"].insert(0, {"name": "reasoned", "lark_grammar": lark})
    return json.dumps(top)


def _answer_text(spec: StructuredSpec) -> str:
    from llguidance import LLMatcher, grammar_from

    kind, text = spec.key
    compact = {"whitespace_flexible": False}
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(text, defaults=compact)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=compact)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    if kind == "grammar":  # GBNF or Lark: llguidance tells them apart and converts GBNF
        return grammar_from("grammar", text)
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
    return "%llguidance {}\nstart: " + alternatives


def _compile(lltok, spec: StructuredSpec, tags=None, eos=()):
    from llguidance import LLMatcher

    kind = spec.kind
    try:
        grammar = grammar_text(spec, tags, eos)
        error = LLMatcher.validate_grammar(grammar, lltok)
    except BadSamplingParams:  # a spec this model cannot take (reasoning without the tags)
        raise
    except Exception as e:  # the library's own error types
        error = str(e) or type(e).__name__
    if not error:
        matcher = LLMatcher(lltok, grammar)
        error = matcher.get_error() if matcher.is_error() else ""
    if error:
        lines = [x.strip() for x in str(error).strip().splitlines() if x.strip()]
        raise BadSamplingParams(
            f"structured.{kind} cannot be compiled: {' '.join(lines[:3])[:300]}"
        ) from None
    return matcher


@dataclass
class GrammarMask:
    """One step's structured-output mask: bit t of bitmask[j] allows token t at sampling row
    rows[j] (apply_bitmask's layout); rows not listed have no grammar."""

    bitmask: torch.Tensor
    rows: list[int]
    owner: GrammarCache | None = None  # counts the time spent masking

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with each listed row's disallowed tokens at -inf (a copy)."""
        t0 = time.perf_counter()
        out = logits.clone()
        apply_bitmask(out, self.bitmask, self.rows)
        if self.owner is not None:
            self.owner.mask_s += time.perf_counter() - t0
        return out
