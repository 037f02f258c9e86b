"""A reasoning model's text split into reasoning and content (router/openai/responses/
reasoning.py) without a server: the split of each output, with the prompt's block open or not,
and the same split whatever pieces the text arrives in (every cut, and one character at a time),
so a stream says what a whole response says. Served: tests/integration/test_reasoning_served.py.
"""

from __future__ import annotations

import pytest

from pdserve.router.openai.responses.reasoning import ChatText, ReasoningParser
from pdserve.router.openai.responses.tool_calls import ToolCallParser


def _split(pieces: list[str], opened: bool) -> tuple[str | None, str | None]:
    parser = ReasoningParser(opened)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    reasoning = "".join(e.get("reasoning", "") for e in events) or None
    return reasoning, "".join(e.get("content", "") for e in events) or None


CASES = [
    ("<think>plan</think>\n\nanswer", False, ("plan", "\n\nanswer")),
    ("\n <think>plan</think>answer", False, ("plan", "answer")),
    ("plan</think>answer", True, ("plan", "answer")),
    ("plan only, cut", True, ("plan only, cut", None)),
    ("plan </thi", True, ("plan </thi", None)),  # a cut-off tag is text
    ("answer", False, (None, "answer")),
    ("answer <think>x</think>", False, (None, "answer <think>x</think>")),
    ("<thinking is not the tag", False, (None, "<thinking is not the tag")),
    ("<thi", False, (None, "<thi")),
    ("  ", False, (None, "  ")),
    ("<think></think>", False, (None, None)),
    ("a</think>b</think>c", True, ("a", "b</think>c")),
]


@pytest.mark.parametrize("text, opened, want", CASES)
def test_the_split_is_the_same_in_any_pieces(text, opened, want):
    assert _split([text], opened) == want
    assert _split(list(text), opened) == want
    for cut in range(len(text) + 1):
        assert _split([text[:cut], text[cut:]], opened) == want, cut


def test_tool_calls_come_from_the_content_and_reasoning_may_be_dropped():
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    text = f"<think>maybe {call}</think>{call}"
    for keep in (True, False):
        parser = ChatText(False, ToolCallParser(forced=False), keep=keep)
        events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
        thought = "".join(e.get("reasoning", "") for e in events)
        assert thought == (f"maybe {call}" if keep else "")
        assert [e["name"] for e in events if "name" in e] == ["f"] and parser.num_calls == 1
        assert not any("content" in e for e in events)


# a reasoning model's output as tokens (the tags are one token each), and how many are reasoning
TOKENS = [
    (["<think>", "pl", "an", "</think>", "\n\n", "ans", "wer"], False, 4),
    (["\n", " ", "<think>", "a", "</think>", "b"], False, 3),
    (["pl", "an", "</think>", "ans"], True, 3),
    (["ans", "<think>", "x", "</think>"], False, 0),
    (["<think>", "a", "b"], False, 3),
]


@pytest.mark.parametrize("tokens, opened, want", TOKENS)
def test_reasoning_tokens_are_counted_whatever_the_deltas_hold(tokens, opened, want):
    """Deltas of one token each, and of every grouping into two, count the same reasoning tokens
    (a worker sends what queued up for a stream as one event)."""
    one_by_one = ReasoningParser(opened)
    for t in tokens:
        one_by_one.feed(t, 1)
    assert one_by_one.tokens == want
    for cut in range(len(tokens) + 1):
        parser = ReasoningParser(opened)
        for part in (tokens[:cut], tokens[cut:]):
            parser.feed("".join(part), len(part), lambda part=part: list(part))
        assert parser.tokens == want, cut
