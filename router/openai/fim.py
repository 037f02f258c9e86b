"""Fill-in-the-middle: a completion's `suffix` (OpenAI's legacy field, which code assistants'
autocomplete sends) served for any code model whose vocabulary has fill-in-the-middle tokens, with
no flag to set. vLLM refuses every `suffix`; llama.cpp's /infill reads the tokens from the
vocabulary, as this does.

`fim_format(tokenizer)` is read once, when the HTTP front starts (router/openai/state.py): the first
of FORMATS whose tokens are all in the vocabulary, or None. A completion with a `suffix` then
becomes the prompt the model was trained on, prefix-suffix-middle: `<prefix token>{prompt}<suffix
token>{suffix}<middle token>`, or for Codestral suffix-prefix: `[SUFFIX]{suffix}[PREFIX]{prompt}`
(the tokenizer reads the tokens' texts as the tokens; a BOS leads where the tokenizer adds one), and
the model writes the middle. Besides the end of text, the tokens that end a middle where the
vocabulary has them (FIM_STOPS: the padding and file-separator tokens the models write after it)
stop it; they are special tokens in those models' tokenizers, so their text is not part of the
answer. A `suffix` for a model without the tokens, with `echo`, or with a prompt of token ids is a
400 naming `suffix` (router/openai/completions.py). Nothing here keeps state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# tokens a model writes after the middle it fills in (llama.cpp ends an infill at them too)
FIM_STOPS = (
    "<|fim_pad|>",
    "<|file_sep|>",
    "<|file_separator|>",
    "<|repo_name|>",
    "<fim_pad>",
    "<file_sep>",
    "<EOT>",
)


@dataclass(frozen=True)
class FimFormat:
    family: str
    prefix: str
    suffix: str
    middle: str  # "": the model writes the middle right after the prefix (suffix first)
    stop_token_ids: tuple[int, ...] = ()

    def prompt(self, prefix: str, suffix: str) -> str:
        """The prompt whose continuation is the middle between `prefix` and `suffix`:
        prefix-suffix-middle, or suffix-prefix where the format has no middle token."""
        if not self.middle:
            return f"{self.suffix}{suffix}{self.prefix}{prefix}"
        return f"{self.prefix}{prefix}{self.suffix}{suffix}{self.middle}"


# Qwen2.5-Coder's and CodeGemma's, StarCoder's (StarCoder2, Granite Code, SantaCoder),
# DeepSeek-Coder's, and Mistral's Codestral (suffix first, as mistral-common's encode_fim)
FORMATS = (
    FimFormat("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    FimFormat("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    FimFormat("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    FimFormat("mistral", "[PREFIX]", "[SUFFIX]", ""),
)


def fim_format(tokenizer) -> FimFormat | None:
    """The model's fill-in-the-middle tokens, or None for a model without them."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for fmt in FORMATS:
        if all(t in vocab for t in (fmt.prefix, fmt.suffix, fmt.middle) if t):
            stops = tuple(vocab[t] for t in FIM_STOPS if t in vocab)
            return replace(fmt, stop_token_ids=stops)
    return None
