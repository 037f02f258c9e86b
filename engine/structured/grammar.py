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
model's chat: the router sets it) puts the grammar after a free reasoning block (`reasoned`), or,
for gpt-oss, after Harmony's analysis messages, in its final channel (`harmony`) or as its call
of a function (`harmony_call`: a forced tool call).
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
        self._harmony = harmony_tags(tokenizer)  # gpt-oss's: a spec's reasoning "harmony"
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
        compiled = _compile(lltok, spec, self._tags, self._eos, self._harmony)
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


def grammar_text(spec: StructuredSpec, tags=None, eos=(), harmony=None) -> str:
    """llguidance's grammar for `spec`: JSON with no free whitespace (the compact separators
    ", " and ": "), so a model cannot pad its output with whitespace until max_tokens; with
    spec.reasoning, after the reasoning (`reasoned`; `tags`: the ids of <think> and </think>,
    `eos`: the stop tokens, never inside the reasoning), or Harmony's (`harmony`: the ids of
    harmony_tags)."""
    if spec.reasoning in HARMONY_NEEDS:
        return harmony_grammar(spec, harmony or {}, eos)
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
    top = _grammars(answer, "answer")
    start = top["grammars"][0]["name"]
    opened, closed = tags
    free = ",".join(str(t) for t in (closed, *eos))
    block = f"<[^{free}]>* <[{closed}]> GAP"
    first = block if reasoning == "open" else f"(<[{opened}]> {block})?"
    # GAP: the whitespace models put after </think> ("\n\n"), bounded so none can pad with it
    lark = f"start: {first} @{start}\nGAP: /[ \\t\\r\\n]{{0,4}}/\n"
    top["grammars"].insert(0, {"name": "reasoned", "lark_grammar": lark})
    return json.dumps(top)


# gpt-oss's Harmony (router/openai/responses/harmony.py reads it): the tags, special tokens of its
# vocabulary (o200k_harmony's), that each reasoning value needs: a message's, and a call's too
_MESSAGE_TAGS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
HARMONY_NEEDS = {
    "harmony": _MESSAGE_TAGS,
    "harmony_call": (*_MESSAGE_TAGS, "<|constrain|>", "<|call|>"),
}
HARMONY_TAGS = (*HARMONY_NEEDS["harmony_call"], "<|return|>")


def harmony_tags(tokenizer) -> dict[str, int]:
    """The ids of Harmony's tags (HARMONY_TAGS) that the vocabulary has as tokens (gpt-oss's has
    all; another model none)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return {tag: vocab[tag] for tag in HARMONY_TAGS if tag in vocab}


def harmony_grammar(spec: StructuredSpec, ids: dict[str, int], eos=()) -> str:
    """The grammar of a gpt-oss output (after the prompt's generation prompt <|start|>assistant)
    whose answer is `spec`'s, as vLLM holds a grammar in Harmony's final channel only: any
    number of analysis messages (before a call, commentary preambles too), each
    <|channel|>analysis<|message|>, free tokens (no Harmony tag, no stop token), <|end|> and
    <|start|>assistant; then, for reasoning "harmony", <|channel|>final<|message|> and the
    answer, which the stop token (<|return|>) ends; for "harmony_call" (spec a forced call's
    {"name", "arguments"} object, `harmony_call_schemas`), the call as gpt-oss writes one:
    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>, the arguments' JSON,
    <|call|>. `ids`: harmony_tags'; BadSamplingParams naming the tags a model lacks."""
    missing = [tag for tag in HARMONY_NEEDS[spec.reasoning] if tag not in ids]
    if missing:
        raise BadSamplingParams(
            f"structured.reasoning {spec.reasoning!r} needs a model that writes Harmony "
            f"(gpt-oss): this one has no {', '.join(missing)} tokens"
        )
    start, channel, message, end = (ids[t] for t in _MESSAGE_TAGS)
    free = ",".join(str(t) for t in sorted({*ids.values(), *eos}))
    # a preamble is content the user sees: before a structured answer it would stand in front
    # of the JSON in the message's content, so only analysis messages come first there
    channels = '"analysis"' if spec.reasoning == "harmony" else '("analysis" | "commentary")'
    lark = (
        f"msg: <[{channel}]> {channels} <[{message}]> <[^{free}]>* <[{end}]> "
        f'<[{start}]> "assistant"\n'
    )
    if spec.reasoning == "harmony":
        top = _grammars(_answer_text(spec), "answer")
        first = top["grammars"][0]["name"]
        lark = f'start: msg* <[{channel}]> "final" <[{message}]> @{first}\n' + lark
    else:
        top = {"grammars": []}
        calls = []
        for i, (name, arguments) in enumerate(harmony_call_schemas(spec)):
            args = _grammars(_json_text(arguments), f"arguments{i}")["grammars"][0]
            args["name"] = f"arguments{i}"
            top["grammars"].append(args)
            header = json.dumps(f"commentary to=functions.{name} ", ensure_ascii=False)
            calls.append(
                f'<[{channel}]> {header} <[{ids["<|constrain|>"]}]> "json" <[{message}]> '
                f"@arguments{i} <[{ids['<|call|>']}]>"
            )
        lark = "start: msg* call\ncall: " + "\n    | ".join(calls) + "\n" + lark
    top["grammars"].insert(0, {"name": spec.reasoning, "lark_grammar": lark})
    return json.dumps(top)


def harmony_call_schemas(spec: StructuredSpec) -> list[tuple[str, dict]]:
    """(name, the arguments' JSON schema) of each call a forced call's schema allows: the object
    {"name": {"const": NAME}, "arguments": SCHEMA} the HTTP front builds for tool_choice
    (router/openai/protocol.py forced_spec), or an anyOf of them ("required"), its arguments' $refs
    moved back to their own root; BadSamplingParams for another spec."""
    schema = spec.json_schema if spec.kind == "json_schema" else None
    one = isinstance(schema, dict) and set(schema) == {"anyOf"}
    alternatives = schema["anyOf"] if one and isinstance(schema["anyOf"], list) else [schema]
    out = []
    for i, alt in enumerate(alternatives):
        props = alt.get("properties") if isinstance(alt, dict) else None
        name = props.get("name") if isinstance(props, dict) else None
        if (
            not isinstance(name, dict)
            or not isinstance(name.get("const"), str)
            or set(props) != {"name", "arguments"}
            or not isinstance(props["arguments"], dict)
        ):
            raise BadSamplingParams(
                "structured.reasoning 'harmony_call' needs a json_schema of a forced call: an "
                'object of "name" (a const) and "arguments" (its schema), or an anyOf of them'
            )
        pointer = f"#/anyOf/{i}/properties/arguments" if one else "#/properties/arguments"
        out.append((name["const"], _rooted(props["arguments"], pointer)))
    return out


def _rooted(schema, pointer: str):
    """`schema` with the local $refs under `pointer` moved to its own root (protocol.py's _rebase
    undone)."""
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            if k == "$ref" and isinstance(v, str) and (v == pointer or v.startswith(pointer + "/")):
                out[k] = "#" + v[len(pointer) :]
            else:
                out[k] = _rooted(v, pointer)
        return out
    if isinstance(schema, list):
        return [_rooted(v, pointer) for v in schema]
    return schema


def _grammars(answer: str, name: str) -> dict:
    """llguidance's top-level grammar object of `answer` (its JSON, or Lark text named `name`)."""
    if answer.lstrip().startswith("{"):
        return json.loads(answer)
    return {"grammars": [{"name": name, "lark_grammar": answer}]}


def _json_text(schema: dict) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False}
    )


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


def _compile(lltok, spec: StructuredSpec, tags=None, eos=(), harmony=None):
    from llguidance import LLMatcher

    kind = spec.kind
    try:
        grammar = grammar_text(spec, tags, eos, harmony)
        error = LLMatcher.validate_grammar(grammar, lltok)
    except BadSamplingParams:  # a spec this model cannot take (reasoning without its tags)
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
