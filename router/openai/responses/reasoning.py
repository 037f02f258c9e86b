"""A reasoning model's output split into its reasoning and its answer, as the text comes: `feed` a
sequence's text deltas, `finish` at its end; each returns events, {"reasoning": text} or
{"content": text}, so a stream and a whole response say the same.

The router says where the output starts (router/service.py REASONING_KEY, from the prompt's last
token: router/text.py opens_reasoning). "open": the chat template ended the prompt with <think>
(DeepSeek-R1's does), so the output is reasoning until </think>. "closed": reasoning only when
the output itself starts with <think> (Qwen3's thinking mode; leading whitespace allowed);
otherwise, as with Qwen3's enable_thinking false (whose template writes an empty closed block),
it is all content. Either way the text after </think> is content, and the tags themselves are
neither. Text that may be the start of a tag is held until it is clearly not one. The answer's
content then goes through the tool call parser (tool_calls.py), as vLLM parses calls only there.
"harmony": gpt-oss's output (OpenAI's Harmony), whose messages' channels say what is reasoning,
answer or call: harmony.py's HarmonyParser reads all three, in place of both parsers.

`reading_of` reads the router's word on both (REASONING_KEY, and TOOL_FORMAT_KEY: the model's
tool call format) into a Reading once per call; `ChatText` is one sequence's pair of parsers.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.tokenizer import THINK_CLOSE, THINK_OPEN
from pdserve.router.chat_tools import HARMONY, TOOL_FORMATS
from pdserve.router.openai.responses.harmony import HarmonyParser
from pdserve.router.openai.responses.tool_calls import ToolCallParser, partial_suffix
from pdserve.router.service import REASONING_KEY, TOOL_FORMAT_KEY  # the router sends them

# where the output is: deciding whether it starts with <think>, inside it, or after it
_START, _REASONING, _CONTENT = "start", "reasoning", "content"


class ReasoningParser:
    def __init__(self, opened: bool):
        self.state = _REASONING if opened else _START
        self.buf = ""
        # the tokens of the deltas fed inside the reasoning (the tags' own included): OpenAI's
        # completion_tokens_details.reasoning_tokens
        self.tokens = 0

    def feed(self, text: str, tokens: int = 0, token_texts=None) -> list[dict]:
        """The events of one delta's `text` (`tokens` tokens). A delta of several tokens may
        hold a tag and tokens on both sides of it (the worker sends what queued up, or several
        tokens a step): `token_texts`, a callable that returns each token's own text, lets them
        count one by one."""
        before = self.state
        if tokens > 1 and token_texts is not None and before != _CONTENT:
            self.tokens += self._count(token_texts())
            return self._feed(text)
        out = self._feed(text)
        if _REASONING in (before, self.state):
            self.tokens += tokens
        return out

    def _count(self, texts: list[str]) -> int:
        """How many of these tokens, fed one at a time from here, are reasoning."""
        shadow = ReasoningParser(False)
        shadow.state, shadow.buf = self.state, self.buf
        for text in texts:
            shadow.feed(text, 1)
        return shadow.tokens

    def _feed(self, text: str) -> list[dict]:
        self.buf += text
        out: list[dict] = []
        if self.state == _START:
            head = self.buf.lstrip()
            if head.startswith(THINK_OPEN):
                self.state, self.buf = _REASONING, head[len(THINK_OPEN) :]
            elif not head or THINK_OPEN.startswith(head):
                return out  # whitespace, or maybe the tag's start: wait
            else:
                self.state = _CONTENT
        if self.state == _REASONING:
            i = self.buf.find(THINK_CLOSE)
            if i < 0:
                keep = partial_suffix(self.buf, THINK_CLOSE)
                out += _event("reasoning", self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                return out
            out += _event("reasoning", self.buf[:i])
            self.state, self.buf = _CONTENT, self.buf[i + len(THINK_CLOSE) :]
        out += _event("content", self.buf)
        self.buf = ""
        return out

    def finish(self) -> list[dict]:
        """What is held at the end: a cut-off tag's start, as the text it is."""
        rest, self.buf = self.buf, ""
        return _event("reasoning" if self.state == _REASONING else "content", rest)


def _event(kind: str, text: str) -> list[dict]:
    return [{kind: text}] if text else []


@dataclass(frozen=True)
class Reading:
    """How a chat's text is read, as the router's initial metadata says: `reasoning` None (not
    split: no reasoning model), HARMONY (gpt-oss's messages), else whether the output starts
    inside the reasoning; `tools` the model's tool call format (router/chat_tools.py
    tool_call_format)."""

    reasoning: bool | str | None = None
    tools: str = "hermes"


async def reading_of(call) -> Reading:
    """A chat's Reading, from its Generate call's initial metadata."""
    reasoning, tools = None, "hermes"
    for key, value in await call.initial_metadata() or ():
        if key == REASONING_KEY:
            reasoning = HARMONY if value == HARMONY else value == "open"
        elif key == TOOL_FORMAT_KEY and value in TOOL_FORMATS:
            tools = value
    return Reading(reasoning, tools)


class ChatText:
    """A chat sequence's text through the parsers its request needs: the reasoning split (a
    reasoning model's; its reasoning dropped with include_reasoning false), then the tool call
    parser on the content (a body with tools). Events as the two parsers give them, in order.
    Harmony's (`reasoning` HARMONY): one HarmonyParser, which gives the calls to `tools` to
    number, a forced call's too (its grammar writes Harmony's call of the function: a Harmony
    model's ToolCallParser is never `forced`)."""

    def __init__(self, reasoning, tools: ToolCallParser | None, keep: bool = True):
        self.tools, self.keep = tools, keep
        self.reasoning: ReasoningParser | HarmonyParser | None = None
        if reasoning == HARMONY:
            if tools is None or not tools.forced:
                self.reasoning = HarmonyParser(tools)
        elif reasoning is not None:
            self.reasoning = ReasoningParser(reasoning)
        self.harmony = isinstance(self.reasoning, HarmonyParser)  # it reads the calls too

    @property
    def num_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0

    @property
    def reasoning_tokens(self) -> int:
        return self.reasoning.tokens if self.reasoning is not None else 0

    def feed(self, text: str, tokens: int = 0, token_texts=None) -> list[dict]:
        if self.reasoning is None:
            return self._content(text)
        return self._split(self.reasoning.feed(text, tokens, token_texts))

    def finish(self) -> list[dict]:
        out = self._split(self.reasoning.finish()) if self.reasoning is not None else []
        if self.tools is not None and not self.harmony:
            out += self.tools.finish()
        return out

    def _split(self, events: list[dict]) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if "content" in e and not self.harmony:
                out += self._content(e["content"])
            elif self.keep or "reasoning" not in e:
                out.append(e)
        return out

    def _content(self, text: str) -> list[dict]:
        if self.tools is not None:
            return self.tools.feed(text)
        return [{"content": text}] if text else []
