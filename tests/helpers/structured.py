"""Structured-output test helpers: a copy of a tiny model with a byte-level tokenizer (the tiny
models' word-level "t0".."t255" cannot spell JSON), schemas and checks of outputs against them."""

from __future__ import annotations

import json
import re
import shutil

# a chat template that takes tools its own way, short (a byte a token): the tools' names, each
# call's name and arguments, each result (the served tool-call and Responses API tests)
TOOL_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %} call {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
# the tool-call tests' function: a city and a unit
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "tag": {"enum": ["a", "b"]}},
                "required": ["id", "tag"],
                "additionalProperties": False,
            },
            "n": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        },
        "required": ["user", "n"],
        "additionalProperties": False,
    },
]


# context-free grammars (structured.grammar) in both notations llguidance reads, each with the
# regular expression of the same (finite, short) language that the checks hold outputs to
GRAMMARS = {
    'root ::= "id-" digit digit? " " tag\ndigit ::= [0-9]\ntag ::= "ok" | "no" | "maybe"': (
        r"id-[0-9]{1,2} (ok|no|maybe)"
    ),
    'start: "(" item ("," item)? ")"\nitem: /[a-c]{1,3}/ | "z"': r"\((?:[a-c]{1,3}|z)(?:,(?:[a-c]{1,3}|z))?\)",
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_level_model(
    tiny_dir: str,
    dest,
    chat_template: str | None = None,
    words: tuple[str, ...] = (),
    special: bool = False,
) -> str:
    """`tiny_dir`'s model with a 256-token byte-level tokenizer: ids 0 and 1 the bos and eos
    tokens, 2..255 the bytes 2..255 (one token per byte, no merges), and `chat_template` in its
    tokenizer config where given. `words` (a reasoning model's "<think>", "</think>") take ids
    2, 3, ... as added tokens, in place of those control bytes: not special (as reasoning
    models' tags), or special (as code models' fill-in-the-middle tokens). Returns the new model
    dir."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    dest = str(dest)
    shutil.copytree(tiny_dir, dest, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.rmtree(f"{dest}/{name}", ignore_errors=True)
    b2u = bytes_to_unicode()
    first = 2 + len(words)
    own = {w: 2 + i for i, w in enumerate(words)}
    vocab = {"<s>": 0, "</s>": 1, **own, **{b2u[b]: b for b in range(first, 256)}}
    tok = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.add_tokens([AddedToken(w, special=special, normalized=False) for w in words])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    ).save_pretrained(dest)
    if chat_template is not None:
        path = f"{dest}/tokenizer_config.json"
        with open(path) as f:
            cfg = json.load(f)
        cfg["chat_template"] = chat_template
        with open(path, "w") as f:
            json.dump(cfg, f)
    return dest


def check_output(spec: dict, text: str) -> None:
    """Raises AssertionError unless `text` satisfies the StructuredSpec keywords `spec`."""
    import jsonschema

    if "json_schema" in spec:
        jsonschema.validate(json.loads(text), spec["json_schema"])
    elif "json_object" in spec:
        assert isinstance(json.loads(text), dict), text
    elif "regex" in spec:
        assert re.fullmatch(spec["regex"], text), (spec["regex"], text)
    elif "grammar" in spec:
        assert re.fullmatch(GRAMMARS[spec["grammar"]], text), (spec["grammar"], text)
    else:
        assert text in spec["choice"], (spec["choice"], text)
