"""Which fill-in-the-middle tokens a vocabulary has, and the prompt each format makes
(router/openai/fim.py; served end to end: tests/integration/test_fim_served.py)."""

from __future__ import annotations

import pytest

from pdserve.router.openai.fim import fim_format


class _Tok:
    def __init__(self, *tokens):
        self.vocab = {t: i for i, t in enumerate(tokens)}

    def get_vocab(self):
        return self.vocab


@pytest.mark.parametrize(
    "tokens, want",
    [
        (
            ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>"),
            "<|fim_prefix|>def f(<|fim_suffix|>):<|fim_middle|>",
        ),
        (
            ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
            "<fim_prefix>def f(<fim_suffix>):<fim_middle>",
        ),
        (
            ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
            "<｜fim▁begin｜>def f(<｜fim▁hole｜>):<｜fim▁end｜>",
        ),
        (("[PREFIX]", "[SUFFIX]"), "[SUFFIX]):[PREFIX]def f("),  # Codestral: suffix first
    ],
)
def test_each_format_makes_its_prompt(tokens, want):
    assert fim_format(_Tok(*tokens)).prompt("def f(", "):") == want


def test_the_stop_tokens_are_those_the_vocabulary_has():
    fmt = fim_format(_Tok("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"))
    assert fmt.family == "qwen" and fmt.stop_token_ids == (3,)


@pytest.mark.parametrize("tokens", [(), ("<|fim_prefix|>", "<|fim_suffix|>"), ("[PREFIX]",)])
def test_a_vocabulary_without_a_whole_format_has_none(tokens):
    assert fim_format(_Tok(*tokens)) is None
