"""What a request's structured output asks for (SamplingParams.structured): a JSON schema, any
JSON object, a regular expression, one of a list of strings, or a context-free grammar (GBNF, as
llama.cpp and vLLM's xgrammar take it, or Lark, as llguidance does). Plain data, checked when
built, with a canonical key: the engine compiles each distinct key once
(engine/structured/grammar.py); the router and the workers build it from their fields
(router/openai/protocol.py, protos/convert.py). No grammar library here, so it imports anywhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve.engine.errors import BadSamplingParams

MAX_SCHEMA_CHARS = 64 * 1024  # a JSON schema, as compact JSON
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024  # per choice
MAX_GRAMMAR_CHARS = 64 * 1024
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# a reasoning model's reasoning before the answer the grammar holds for: "" unset (the router
# sets it for a reasoning model), "none" (the grammar holds from the first token), "open" (the
# output is reasoning until </think>), "optional" (it may start with a <think>...</think> block);
# gpt-oss's (Harmony's messages: engine/structured/grammar.py harmony_grammar): "harmony" (the
# answer in the final channel, after any analysis messages), "harmony_call" (the spec a forced
# tool call's {"name", "arguments"} object, written as Harmony's call of that function)
REASONING = ("", "none", "open", "optional", "harmony", "harmony_call")


@dataclass(frozen=True)
class StructuredSpec:
    """Exactly one of the fields: json_schema (a dict, or its JSON text), json_object (True: any
    JSON object), regex (the whole output matches it), choice (the output is one of these),
    grammar (the output is a sentence of it: GBNF rules `root ::= ...` or Lark's `start: ...`).
    reasoning (REASONING): a reasoning model's reasoning comes first, free, and the kind holds
    for the answer after it (engine/structured/grammar.py); "harmony_call" only with a
    json_schema (a forced call's)."""

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    reasoning: str = ""

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        given = [
            k for k in KINDS if (getattr(self, k) is not None and getattr(self, k) is not False)
        ]
        if len(given) != 1:
            raise BadSamplingParams(
                f"structured must set exactly one of {', '.join(KINDS)}, got "
                f"{', '.join(given) or 'none'}"
            )
        if self.reasoning not in REASONING:
            raise BadSamplingParams(
                f"structured.reasoning must be one of {list(REASONING)}, got {self.reasoning!r:.40}"
            )
        if self.reasoning == "harmony_call" and self.json_schema is None:
            raise BadSamplingParams(
                "structured.reasoning 'harmony_call' needs a json_schema (a forced tool call's "
                f"{{name, arguments}} object), got {', '.join(given)}"
            )
        if self.json_schema is not None:
            put("json_schema", _schema(self.json_schema))
        if not isinstance(self.json_object, bool):
            raise BadSamplingParams(
                f"structured.json_object must be a bool, got {type(self.json_object).__name__}"
            )
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise BadSamplingParams(
                    f"structured.regex must be a non-empty str, got {self.regex!r:.80}"
                )
            if len(self.regex) > MAX_REGEX_CHARS:
                raise BadSamplingParams(
                    f"structured.regex has {len(self.regex)} characters; at most "
                    f"{MAX_REGEX_CHARS} are allowed"
                )
        if self.choice is not None:
            put("choice", _choices(self.choice))
        if self.grammar is not None and (
            not isinstance(self.grammar, str)
            or not self.grammar.strip()
            or len(self.grammar) > MAX_GRAMMAR_CHARS
        ):
            raise BadSamplingParams(
                f"structured.grammar must be a non-empty str of at most {MAX_GRAMMAR_CHARS} "
                f"characters, got {type(self.grammar).__name__} of {len(str(self.grammar))}"
            )

    @property
    def kind(self) -> str:
        return next(
            k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False
        )

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal specs have equal keys (dict key order does not matter)."""
        kind = self.kind
        if kind == "json_schema":
            return kind, canonical_json(self.json_schema)
        if kind == "json_object":
            return kind, ""
        if kind in ("regex", "grammar"):
            return kind, getattr(self, kind)
        return kind, json.dumps(list(self.choice))

    def to_wire(self) -> dict:
        """The one set field, JSON-able (json_schema as canonical JSON text), and reasoning."""
        kind, text = self.key
        if kind == "choice":
            out: dict = {"choice": list(self.choice)}
        elif kind == "json_object":
            out = {"json_object": True}
        else:
            out = {kind: text}
        return {**out, "reasoning": self.reasoning} if self.reasoning else out


def canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _schema(value: object) -> dict:
    if isinstance(value, str):
        if len(value) > 4 * MAX_SCHEMA_CHARS:
            raise BadSamplingParams(
                f"structured.json_schema has {len(value)} characters; at most "
                f"{MAX_SCHEMA_CHARS} (as compact JSON) are allowed"
            )
        try:
            value = json.loads(value)
        except ValueError as e:
            raise BadSamplingParams(f"structured.json_schema is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise BadSamplingParams(
            f"structured.json_schema must be a JSON object (a dict), got {type(value).__name__}"
        )
    try:
        text = canonical_json(value)
    except (TypeError, ValueError) as e:
        raise BadSamplingParams(f"structured.json_schema is not JSON data: {e}") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise BadSamplingParams(
            f"structured.json_schema has {len(text)} characters as compact JSON; at most "
            f"{MAX_SCHEMA_CHARS} are allowed"
        )
    return value


def _choices(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise BadSamplingParams(
            f"structured.choice must be a list of str, got {type(value).__name__}"
        )
    if not value:
        raise BadSamplingParams("structured.choice must hold at least one str")
    if len(value) > MAX_CHOICES:
        raise BadSamplingParams(
            f"structured.choice has {len(value)} entries; at most {MAX_CHOICES} are allowed"
        )
    for c in value:
        if not isinstance(c, str) or not c:
            raise BadSamplingParams(
                f"structured.choice must hold only non-empty str, got {c!r:.80}"
            )
        if len(c) > MAX_CHOICE_CHARS:
            raise BadSamplingParams(
                f"a structured.choice entry has {len(c)} characters; at most "
                f"{MAX_CHOICE_CHARS} are allowed"
            )
    return tuple(value)


def spec_from_wire(value: object) -> StructuredSpec:
    """A StructuredSpec from to_wire()'s dict (or a dict a client sent with one of the kinds)."""
    if isinstance(value, StructuredSpec):
        return value
    if not isinstance(value, dict):
        raise BadSamplingParams(
            f"structured must be a StructuredSpec or a dict, got {type(value).__name__}"
        )
    known = [*KINDS, "reasoning"]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise BadSamplingParams(f"structured has unknown fields {unknown}; known: {known}")
    return StructuredSpec(**value)
