"""A tokenizer that writes OpenAI's Harmony, for the tests of gpt-oss's output (router/openai/
responses/harmony.py) without gpt-oss's 200k-token one: byte-level, one token a byte (no merges),
Harmony's tags special tokens as o200k_harmony has them, and a short chat template that reads an
assistant's reasoning as gpt-oss's does (`thinking`, refused beside content on a turn with a
call); or, `tags` empty, the same tokenizer without them. Built in memory, in milliseconds.
Also the engine's grammars on it, fed an output token by token as the engine feeds them
(`harmony_grammars`, `taken`), and a router stub that answers a Harmony output (`HarmonyRouter`).

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


def harmony_grammars(tok=None):
    """The engine's GrammarCache (engine/structured/grammar.py) on a Harmony tokenizer, its stop
    token <|return|> where it has one."""
    from pdserve.engine.structured.grammar import GrammarCache

    tok = tok if tok is not None else harmony_tokenizer()
    eos = () if tok.eos_token_id is None else (tok.eos_token_id,)
    return GrammarCache(tok, len(tok), eos)


def taken(grammar, ids: list[int]) -> int | None:
    """Feeds `ids` to a sequence's grammar (a SeqGrammar) as the engine does, each first checked
    against the step's mask: None when every token was allowed and the grammar is then complete,
    else the index of the first token refused (len(ids) when all were taken but it is not
    complete)."""
    import torch

    words = (grammar.owner._vocab_size + 31) // 32
    for i, t in enumerate(ids):
        mask = torch.zeros((1, words), dtype=torch.int32)
        grammar.fill(mask, 0)
        if not (int(mask[0, t // 32]) >> (t % 32)) & 1:
            return i
        grammar.accept(t)
    return None if grammar.matcher.is_stopped() else len(ids)


class HarmonyRouter:
    """The router's gRPC stub for the HTTP front: each Generate (kept in `gens`) answers `output`
    as a decode worker's deltas of three tokens (the stop token's text left out, as the engine
    leaves it) with a Harmony chat's initial metadata."""

    def __init__(self, tok, output: str):
        self.tok, self.ids, self.gens = tok, tok.encode(output, add_special_tokens=False), []

    def Generate(self, gen, metadata=(), timeout=None):
        from helpers.http_front import FakeCall
        from pdserve.protos.pdserve.v1 import pdserve_pb2
        from pdserve.router.chat_tools import HARMONY
        from pdserve.router.service import REASONING_KEY, TOOL_FORMAT_KEY

        self.gens.append(gen)
        out, ids = [], self.ids
        for at in range(0, len(ids), 3):
            part = ids[at : at + 3]
            shown = part[:-1] if at + 3 >= len(ids) else part  # the last: a stop token
            text = self.tok.decode(shown, skip_special_tokens=False)
            delta = pdserve_pb2.TokenDelta(index=0, token_ids=part, text=text)
            out.append(pdserve_pb2.GenerateResponse(delta=delta))
        finish = pdserve_pb2.Finish(index=0, finish_reason="stop")
        finish.usage.prompt_tokens, finish.usage.completion_tokens = 5, len(ids)
        call = FakeCall([*out, pdserve_pb2.GenerateResponse(finish=finish)])
        meta = ((REASONING_KEY, HARMONY), (TOOL_FORMAT_KEY, HARMONY))

        async def initial_metadata():
            return meta

        call.initial_metadata = initial_metadata
        return call
