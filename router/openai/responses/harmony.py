"""gpt-oss's output, OpenAI's Harmony, read as it comes into reasoning, content and tool calls:
the same `feed` / `finish` events as reasoning.py's ReasoningParser and tool_calls.py's
ToolCallParser ({"reasoning": text}, {"content": text}, a call's {"index", "id", "name",
"arguments"}), so a stream and a whole response say the same.

The output is a sequence of messages, each a header then a body:

    [<|start|>ROLE][ to=TO]<|channel|>CHANNEL[ to=TO][ [<|constrain|>]FORMAT]<|message|>

(TO the recipient), then the body, which ends at <|end|>, <|call|> or <|return|> (the last two
end the sequence: the engine leaves a stop token's text out, so a body may also just stop, as at
max_tokens). The first message's <|start|>assistant is the prompt's (the template's generation
prompt), and a header is held whole, so whatever comes before <|channel|> is read. As vLLM
maps them: channel "analysis" is reasoning; "final", and "commentary" with no recipient (a
preamble the user sees), are content; a recipient functions.NAME, on any channel, makes the body
a call of NAME whose arguments are the body's text, given when the body ends. Headers and tags
are in no field; a body's text that may be the start of an end tag is held until it is clearly
not one. The router tells the HTTP front that a model writes Harmony (router/service.py
REASONING_KEY "harmony", from its vocabulary: router/chat_tools.py tool_call_format).

Structured output holds in the final channel, after any analysis messages, and a forced tool
call's grammar is Harmony's call of the function (engine/structured/grammar.py harmony_grammar,
the router's choice): both read as any output is. An output with no Harmony at all (a grammar
held from the first token) is content, or a forced call's {"name", "arguments"} object.
"""

from __future__ import annotations

import copy
import re

from pdserve.router.chat_tools import HARMONY_TAGS

START, CHANNEL, MESSAGE, END = HARMONY_TAGS
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN)  # what ends a message's body
FUNCTIONS = "functions."  # the client's tools' namespace in a recipient

_RECIPIENT = re.compile(r"to=([^\s<]+)")
# where the output is: in a message's header, or in its body
_HEADER, _BODY = "header", "body"
# what a body is
_REASONING, _CONTENT, _CALL = "reasoning", "content", "call"


def partial_end(text: str) -> int:
    """Length of the longest suffix of `text` that may be the start of an end tag."""
    for n in range(min(len(text), max(map(len, ENDS)) - 1), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in ENDS):
            return n
    return 0


def recipient_and_channel(header: str) -> tuple[str | None, str]:
    """A header's recipient (None without one: the user) and channel ("" without one); the
    recipient may be in the role's part, before <|channel|>, or after the channel."""
    role, _, rest = header.partition(CHANNEL)
    found = _RECIPIENT.search(role) or _RECIPIENT.search(rest)
    words = rest.replace(CONSTRAIN, " ").split()
    return (found.group(1) if found else None), (words[0] if words else "")


class HarmonyParser:
    def __init__(self, tools=None):
        """tools: the request's ToolCallParser (tool_calls.py), which numbers and names each
        call as its own (parallel_tool_calls false keeps the first); None when the request
        offers no tools (or tool_choice none): then a call of functions.NAME is no call the
        client can take, and its body is reasoning, as a built-in tool's is."""
        self.tools = tools
        self.state, self.buf = _HEADER, ""
        self.kind, self.name, self.args = _CONTENT, "", ""  # the open body's
        self.opened = False  # a message's body began: the output is Harmony
        # the tokens of reasoning messages, headers and tags included: OpenAI's
        # completion_tokens_details.reasoning_tokens; `pending` those of the header being read,
        # whose channel says whether they are
        self.tokens = 0
        self.pending = 0

    @property
    def num_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0

    def feed(self, text: str, tokens: int = 0, token_texts=None) -> list[dict]:
        """The events of one delta's `text` (`tokens` tokens); `token_texts`, a callable that
        returns each token's own text, lets a delta of several tokens that crosses a message's
        bounds count them one by one (as ReasoningParser.feed)."""
        if tokens > 1 and token_texts is not None:
            shadow = copy.copy(self)  # (its _feed touches nothing of this one's)
            for piece in token_texts():
                shadow._counted(piece, 1)
            self.pending = 0  # the shadow counted this delta's headers
            out = self._feed(text)
            self.tokens, self.pending = shadow.tokens, shadow.pending
        else:
            out = self._counted(text, tokens)
        return self._events(out)

    def finish(self) -> list[dict]:
        """What is held at the end: a body's rest (a cut-off call is given as far as it came); a
        header cut off is dropped, unless the output held no Harmony at all (a structured output
        grammar's, held from the first token), whose text is content, or a forced call's
        object (`tools.required`) read as tool_calls.py reads one."""
        rest, self.buf = self.buf, ""
        if self.state == _BODY:
            return self._events(self._body(rest) + self._close())
        if self.opened or not rest:
            return []
        if self.tools is not None and self.tools.required and rest.lstrip().startswith("{"):
            return self.tools.forced_object(rest)
        return [{_CONTENT: rest}] if "<|" not in rest else []

    def _counted(self, text: str, tokens: int) -> list[dict]:
        """_feed, with `tokens` counted: in a reasoning body, or pending in a header."""
        if self.state == _BODY:
            self.tokens += tokens if self.kind == _REASONING else 0
        else:
            self.pending += tokens
        return self._feed(text)

    def _feed(self, text: str) -> list[dict]:
        self.buf += text
        out: list[dict] = []
        while True:
            if self.state == _HEADER:
                i = self.buf.find(MESSAGE)
                if i < 0:
                    return out
                self._open(self.buf[:i])
                self.buf = self.buf[i + len(MESSAGE) :]
            ends = [(j, tag) for tag in ENDS if (j := self.buf.find(tag)) >= 0]
            if not ends:
                keep = len(self.buf) - partial_end(self.buf)
                out += self._body(self.buf[:keep])
                self.buf = self.buf[keep:]
                return out
            j, tag = min(ends)
            out += self._body(self.buf[:j]) + self._close()
            self.buf = self.buf[j + len(tag) :]

    def _open(self, header: str) -> None:
        """A message's body starts: what it is, by its header."""
        recipient, channel = recipient_and_channel(header)
        self.state, self.opened, self.args = _BODY, True, ""
        if recipient is None:
            self.kind = _REASONING if channel == "analysis" else _CONTENT
        elif recipient.startswith(FUNCTIONS) and self.tools is not None:
            self.kind, self.name = _CALL, recipient.removeprefix(FUNCTIONS)
        else:
            # a built-in tool's call (browser.search, python: the template's builtin_tools),
            # which the client did not define and cannot run: not a tool call, nor an answer,
            # but a step of the model's own work, so reasoning (as vLLM shows it)
            self.kind = _REASONING
        if self.kind == _REASONING:
            self.tokens += self.pending
        self.pending = 0

    def _body(self, text: str) -> list[dict]:
        if not text:
            return []
        if self.kind == _CALL:
            self.args += text
            return []
        return [{self.kind: text}]

    def _close(self) -> list[dict]:
        """The open body ends: a call's event (read into the request's by `_events`)."""
        self.state = _HEADER
        if self.kind != _CALL:
            return []
        return [{_CALL: (self.name, self.args)}]

    def _events(self, raw: list[dict]) -> list[dict]:
        out: list[dict] = []
        for e in raw:
            out += self.tools.call(*e[_CALL]) if _CALL in e else [e]
        return out
