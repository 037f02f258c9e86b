"""A tokenizer that writes OpenAI's Harmony, for the tests of gpt-oss's output (router/openai/
responses/harmony.py) without gpt-oss's 200k-token one: byte-level, one token a byte (no merges),
Harmony's tags special tokens as o200k_harmony has them, and a short chat template that reads an
assistant's reasoning as gpt-oss's does (`thinking`, refused beside content on a turn with a
call); or, `tags` empty, the same tokenizer without them. Built in memory, in milliseconds.

Not a test module: imported as `from helpers.harmony import ...`.
"""

from __future__ import annotations

from helpers.structured import bytes_to_unicode

TAGS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>")
TAGS += ("<|call|>",)

# gpt-oss's template's rules, short: the tools' names in a developer message, an assistant's
# reasoning read as `thinking`, a turn with a call written as one analysis message (content and
# thinking both refused) then the call, and <|start|>assistant the generation prompt
TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|>{% for t in tools %}{{ t.function.name }} "
    "{% endfor %}<|end|>{% endif %}{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}"
    "{% if m.content and m.thinking %}{{ raise_exception('Cannot pass both content and thinking"
    " in an assistant message with tool calls!') }}{% endif %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking or m.content }}<|end|>"
    "<|start|>assistant to=functions.{{ m.tool_calls[0].function.name }}<|channel|>commentary"
    " json<|message|>{{ m.tool_calls[0].function.arguments | tojson }}<|call|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def harmony_tokenizer(tags: tuple[str, ...] = TAGS, chat_template: str | None = TEMPLATE):
    """A PreTrainedTokenizerFast of the 256 bytes (ids 0..255) and `tags` as special tokens
    (ids 256 on); <|return|> its eos where it has one."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    b2u = bytes_to_unicode()
    tok = Tokenizer(models.BPE({b2u[b]: b for b in range(256)}, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tags])
    eos = {"eos_token": "<|return|>"} if "<|return|>" in tags else {}
    out = PreTrainedTokenizerFast(tokenizer_object=tok, **eos)
    out.chat_template = chat_template
    return out
