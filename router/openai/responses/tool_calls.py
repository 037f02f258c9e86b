"""Tool calls parsed out of a chat output (router/openai/protocol.py says when), as the text
comes: `feed` a sequence's text deltas, `finish` at its end; each returns events, dicts in the
shape of a chat delta's pieces: {"content": text} or {"index": k, "id", "name", "arguments":
chunk} (id and name on a call's first event only). A whole response joins the same events, so
a stream and a whole response say the same.

    auto    in the model's format (router/chat_tools.py tool_call_format):
            hermes: <tool_call>{"name", "arguments"}</tool_call> blocks (Qwen2.5's, Qwen3's), or
            blocks of Qwen3-Coder's XML, <function=NAME> then <parameter=KEY>VALUE</parameter>
            each (vLLM's qwen3_coder parser), or of GLM-4.5's, NAME then <arg_key>KEY</arg_key>
            <arg_value>VALUE</arg_value> each (vLLM's glm45); each value is read as its tool's
            JSON schema types the parameter: text for a string, else JSON where it parses. The
            text outside the blocks is content. Text that may be the start of "<tool_call>" is
            held until it is clearly not one; a block is given when it closes (or at the end,
            unclosed). A block that is none of these calls stays content, as it was written.
            llama3_json: an output that starts with "{" (or <|python_tag|>) is held to its end and
            read as calls {"name", "parameters"}, one or more separated by ";" (Llama 3.1's);
            any other output is content as it comes.
            mistral: content until [TOOL_CALLS], then the calls, read at the end: a JSON list of
            {"name", "arguments"}, or name[ARGS]{...} each after its own [TOOL_CALLS] (newer).
            deepseek: content until <｜tool▁calls▁begin｜>, then calls read at the end, each
            <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜> (V3.1's) or
            <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME then a ```json block (V3's, R1's).
            kimi_k2: content until <|tool_calls_section_begin|>, then calls read at the end,
            each <|tool_call_begin|>functions.NAME:i<|tool_call_argument_begin|>{...}.
            Held text that is not calls is content, as it was written.
            harmony: gpt-oss's calls are read by harmony.py with its reasoning and answer,
            and given here (`call`) to be numbered as these are.
    forced  the whole output is one {"arguments", "name"} object (the grammar's; its keys come
            sorted, as the engine canonicalizes a schema): the call is given when it ends. An
            object cut off (max_tokens, a stop string) is still the call, as vLLM gives a cut
            forced call: its arguments as far as they came (JSON text that may not parse), named
            by the object when its name came whole, else by the tool it must be (the named
            choice's, or the only tool); a call that cannot be named, or that never began, is
            nothing (never the grammar's object as content). A Harmony model's forced call is
            the router's grammar's Harmony call of the function, after its analysis messages
            (engine/structured/grammar.py harmony_grammar): harmony.py reads it with them, as
            any of its calls (`forced` False here, `required` True), and the bare object only
            where the grammar held from the first token (`forced_object`).
"""

from __future__ import annotations

import json
import re
import uuid

from pdserve.router.chat_tools import HARMONY, SECTION_TAGS

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_call(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call's JSON, None when it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return _call_of(obj)


def _call_of(obj) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a decoded call, None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


# Qwen3-Coder's call inside a <tool_call> block: the function, then its parameters
_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _xml_call(body: str, schemas: dict) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a Qwen3-Coder call, None when `body` is not one; each
    value typed by `schemas` (tool name -> its parameters' JSON schema)."""
    m = _XML_FUNCTION.match(body)
    if m is None or m.group(1).strip() == "":
        return None
    name = m.group(1).strip()
    properties = (schemas.get(name) or {}).get("properties") or {}
    args = {}
    for key, raw in _XML_PARAMETER.findall(m.group(2)):
        value = raw.removeprefix("\n").removesuffix("\n")
        args[key.strip()] = _typed(value, (properties.get(key.strip()) or {}).get("type"))
    return name, json.dumps(args, ensure_ascii=False)


# GLM-4.5's call inside a <tool_call> block: the name on its own, then key/value pairs
_GLM_CALL = re.compile(r"\s*([^<>\s{}\[\]\"][^<>\n{}]*?)\s*((?:<arg_key>.*)?)$", re.S)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.S)


def _glm_call(body: str, schemas: dict) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a GLM-4.5 call, None when `body` is not one: a name
    (one word) alone or followed by key/value pairs only."""
    m = _GLM_CALL.match(body)
    if m is None or any(c.isspace() for c in m.group(1).strip()):
        return None
    name, rest = m.group(1).strip(), m.group(2)
    pairs = _GLM_ARG.findall(rest)
    if rest.strip() and not pairs:
        return None
    properties = (schemas.get(name) or {}).get("properties") or {}
    args = {k.strip(): _typed(v, (properties.get(k.strip()) or {}).get("type")) for k, v in pairs}
    return name, json.dumps(args, ensure_ascii=False)


def _typed(value: str, kind) -> object:
    """A parameter's text as its schema's type says: text for a string (or a type that lists
    string), null for "null", else the JSON it parses as, else the text."""
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds:
        return value
    if value.strip().lower() == "null":
        return None
    if "boolean" in kinds and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        return value


class ToolCallParser:
    def __init__(
        self,
        forced: bool,
        single: bool = False,
        fmt: str = "hermes",
        tools: list | None = None,
        name: str | None = None,
    ):
        """forced: the grammar's one call; single: parallel_tool_calls=false, the first call
        kept and any later one dropped (vLLM's and OpenAI's rule); fmt: the model's format in
        auto mode (the module's docstring); tools: the request's (OpenAI's function tools), whose
        parameter schemas type an XML call's values; name: a forced call's tool when the request
        names it (tool_choice), which names a call cut off before its name came."""
        self.single, self.fmt, self.name = single, fmt, name
        # one call is the output (tool_choice "required" or a named function); read here as the
        # grammar's object, except a Harmony model's: its Harmony call, read by harmony.py
        self.required = forced
        self.forced = forced and fmt != HARMONY
        self.schemas = {}
        for tool in tools or ():
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                self.schemas[function["name"]] = function.get("parameters") or {}
        self.content_only = False  # llama3_json: decided that the output is not a call
        self.buf = ""
        self.in_call = False
        self.num_calls = 0
        self.pending_space = ""  # trailing whitespace of the content so far: held

    # ---- events
    def _content(self, text: str) -> list[dict]:
        """Content, less trailing whitespace, which waits for more content (dropped at the end,
        so the space around and between calls is not content)."""
        text = self.pending_space + text
        body = text.rstrip()
        self.pending_space = text[len(body) :]
        return [{"content": body}] if body else []

    def _call(self, name: str, arguments: str) -> list[dict]:
        if self.single and self.num_calls:
            return []
        self.num_calls += 1
        return [
            {"index": self.num_calls - 1, "id": call_id(), "name": name, "arguments": arguments}
        ]

    def call(self, name: str, arguments: str) -> list[dict]:
        """The event of a call another parser read (harmony.py's), numbered as this one's."""
        return self._call(name, arguments)

    def forced_object(self, text: str) -> list[dict]:
        """The events of a forced call's whole output `text` read as the grammar's bare object
        (harmony.py's, for an output that holds no Harmony)."""
        self.buf = text
        return self._forced_finish()

    # ---- feeding
    def feed(self, text: str) -> list[dict]:
        self.buf += text
        if self.forced:
            return self._forced_feed()
        return self._auto_feed() if self.fmt == "hermes" else self._held_feed()

    def finish(self) -> list[dict]:
        if self.forced:
            return self._forced_finish()
        return self._auto_finish() if self.fmt == "hermes" else self._held_finish()

    def _held_feed(self) -> list[dict]:
        """llama3_json and the sectioned formats: content until the calls start, which are held
        to the end."""
        if self.in_call:
            return []
        section = SECTION_TAGS.get(self.fmt)
        if section is not None:
            i = self.buf.find(section)
            if i < 0:
                keep = partial_suffix(self.buf, section)
                out = self._content(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                return out
            out = self._content(self.buf[:i])
            self.buf, self.in_call = self.buf[i:], True
            return out
        if self.content_only:
            out, self.buf = self._content(self.buf), ""
            return out
        head = self.buf.lstrip()
        if head.startswith(("{", PYTHON_TAG)):
            self.in_call = True
        elif head and not PYTHON_TAG.startswith(head):
            self.content_only = True
            out, self.buf = self._content(self.buf), ""
            return out
        return []

    def _held_finish(self) -> list[dict]:
        rest, self.buf = self.buf, ""
        if not self.in_call:
            return self._content(rest)
        self.in_call = False
        calls = _READERS.get(self.fmt, _json_calls)(rest)
        if calls is None:  # not calls after all: the text as it was written
            return self._content(rest)
        return [e for call in calls for e in self._call(*call)]

    def _auto_feed(self) -> list[dict]:
        out: list[dict] = []
        while True:
            if not self.in_call:
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = partial_suffix(self.buf, OPEN)
                    out += self._content(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    return out
                out += self._content(self.buf[:i])
                self.buf, self.in_call = self.buf[i + len(OPEN) :], True
            j = self.buf.find(CLOSE)
            if j < 0:
                return out
            out += self._block(self.buf[:j], closed=True)
            self.buf, self.in_call = self.buf[j + len(CLOSE) :], False

    def _block(self, body: str, closed: bool) -> list[dict]:
        call = (
            _as_call(body.strip()) or _xml_call(body, self.schemas) or _glm_call(body, self.schemas)
        )
        if call is None:
            return self._content(OPEN + body + (CLOSE if closed else ""))
        return self._call(*call)

    def _auto_finish(self) -> list[dict]:
        rest, self.buf = self.buf, ""
        if self.in_call:
            self.in_call = False
            return self._block(rest, closed=False)
        return self._content(rest)

    def _forced_feed(self) -> list[dict]:
        return []  # the grammar's object is read whole at the end

    def _forced_finish(self) -> list[dict]:
        call = _as_call(self.buf.strip())
        if call is not None:
            return self._call(*call)
        if not self.buf.strip():  # cut off before the call began (a reasoning model's)
            return []
        # cut off (max_tokens): the call as far as it came, when it can be named
        name, arguments = _cut_call(self.buf)
        if name is None:
            only = list(self.schemas) if len(self.schemas) == 1 else [None]
            name = self.name or only[0]
        return [] if name is None else self._call(name, arguments)


def _cut_call(text: str) -> tuple[str | None, str]:
    """(name, arguments) of a forced call's object cut off before its end: its members read in
    order while they are whole; the name when it came whole (else None), the arguments as JSON
    text, whole or as far as they came ("" when they had not begun)."""
    decoder, whole, cut = json.JSONDecoder(), {}, ""
    text = text.strip()
    i = 1 if text.startswith("{") else len(text)
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            key, i = decoder.raw_decode(text, i)
        except ValueError:
            break
        colon = text.find(":", i)
        if not isinstance(key, str) or colon < 0 or text[i:colon].strip():
            break
        i = colon + 1
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        try:
            whole[key], i = decoder.raw_decode(text, i)
        except ValueError:
            cut = text[i:] if key == "arguments" else ""
            break
    name, args = whole.get("name"), whole.get("arguments")
    arguments = json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else cut
    return (name if isinstance(name, str) else None), arguments


PYTHON_TAG, MISTRAL, MISTRAL_ARGS = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"


def _json_calls(text: str) -> list[tuple[str, str]] | None:
    """Llama 3.1's calls: JSON objects separated by ";" (or commas, whitespace), after an
    optional <|python_tag|>; None unless every object is a call."""
    text = text.strip().removeprefix(PYTHON_TAG)
    decoder, i, out = json.JSONDecoder(), 0, []
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            return out or None
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        call = _call_of(obj)
        if call is None:
            return None
        out.append(call)


def _mistral_calls(text: str) -> list[tuple[str, str]] | None:
    """Mistral's calls after [TOOL_CALLS]: a JSON list of {"name", "arguments"}, or (newer
    tokenizers) name[ARGS]{...} after each [TOOL_CALLS]; None unless all of it is calls."""
    parts = [p.strip() for p in text.split(MISTRAL)[1:]]
    if len(parts) == 1 and parts[0].startswith("["):
        try:
            objs = json.loads(parts[0])
        except ValueError:
            return None
        calls = [_call_of(o) for o in objs] if isinstance(objs, list) else [None]
    else:
        calls = []
        for part in parts:
            name, sep, args = part.partition(MISTRAL_ARGS)
            calls.append(_as_call_parts(name.strip(), args) if sep else None)
    return None if not calls or None in calls else calls


DS_CALL, DS_SEP, DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
KIMI_CALL, KIMI_ARGS, KIMI_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)


def _deepseek_calls(text: str) -> list[tuple[str, str]] | None:
    """DeepSeek's calls after <｜tool▁calls▁begin｜>; None unless every part is a call."""
    calls = []
    for part in text.split(DS_CALL)[1:]:
        head, sep, tail = part.split(DS_END)[0].partition(DS_SEP)
        if not sep:
            return None
        if head.strip() == "function" and "```" in tail:  # V3's: the name, then a json block
            name, _, block = tail.partition("\n")
            args = block.strip().removeprefix("```json").removesuffix("```")
        else:  # V3.1's: the name, then the arguments' JSON
            name, args = head, tail
        calls.append(_as_call_parts(name.strip(), args))
    return None if not calls or None in calls else calls


def _kimi_calls(text: str) -> list[tuple[str, str]] | None:
    """Kimi K2's calls after <|tool_calls_section_begin|>: each functions.NAME:i, then its
    arguments' JSON; None unless every part is a call."""
    calls = []
    for part in text.split(KIMI_CALL)[1:]:
        ident, sep, args = part.split(KIMI_END)[0].partition(KIMI_ARGS)
        name = ident.strip().removeprefix("functions.").rpartition(":")[0]
        calls.append(_as_call_parts(name, args) if sep else None)
    return None if not calls or None in calls else calls


_READERS = {"mistral": _mistral_calls, "deepseek": _deepseek_calls, "kimi_k2": _kimi_calls}


def _as_call_parts(name: str, arguments: str) -> tuple[str, str] | None:
    try:
        args = json.loads(arguments)
    except ValueError:
        return None
    return _call_of({"name": name, "arguments": args}) if name else None


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def join_events(events: list[dict]) -> tuple[str | None, list[dict]]:
    """(content or None, OpenAI's tool_calls) of a sequence's events (reasoning.py's reasoning
    events are read by the caller)."""
    content = "".join(e["content"] for e in events if "content" in e)
    calls: dict[int, dict] = {}
    for e in events:
        if "index" not in e:
            continue
        c = calls.setdefault(
            e["index"],
            {"id": None, "type": "function", "function": {"name": None, "arguments": ""}},
        )
        if "id" in e:
            c["id"], c["function"]["name"] = e["id"], e["name"]
        c["function"]["arguments"] += e["arguments"]
    return (content or None), [calls[i] for i in sorted(calls)]


def delta_of(event: dict) -> dict:
    """A chat chunk's delta for one event (reasoning.py's too: a reasoning model's reasoning
    under both names clients read, vLLM's `reasoning` and DeepSeek's `reasoning_content`)."""
    if "content" in event:
        return {"content": event["content"]}
    if "reasoning" in event:
        return {"reasoning": event["reasoning"], "reasoning_content": event["reasoning"]}
    call: dict = {"index": event["index"]}
    if "id" in event:
        call.update(id=event["id"], type="function")
        call["function"] = {"name": event["name"], "arguments": event["arguments"]}
    else:
        call["function"] = {"arguments": event["arguments"]}
    return {"tool_calls": [call]}
