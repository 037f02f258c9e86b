"""Tools in a rendered chat (router/text.py's PromptEncoder): a pdserve.v1.ChatMessages' tools
(`tools_json`), assistant tool calls (`tool_calls_json`) and "tool" messages (`tool_call_id`)
turned into what apply_chat_template takes.

A template that knows tools (its source names `tools`, and `tool_calls` for the calls, as
Qwen2.5's, Qwen3's, Llama 3.1's and Hermes' do) gets them its own way: `tools=` and the messages
in HF's shape (a call's arguments as a dict). A template that does not (SmolLM2's ignores both)
gets them in Hermes' style (Qwen2.5's words), so the model still sees them: the tools' JSON in
<tools></tools> and the <tool_call>{"name", "arguments"}</tool_call> output format in the system
message, each call as a <tool_call> block in its assistant message, and tool results as user
messages of <tool_response> blocks (consecutive ones joined). The HTTP front parses the calls
back out of the output (router/openai/responses/tool_calls.py) in the format `tool_call_format`
reads from the tokenizer and its template: no flag to set, where vLLM takes --tool-call-parser.
An assistant's reasoning reaches the template as reasoning_content, and a Harmony template's
(gpt-oss's) as the `thinking` it reads (`_harmony_thinking`).
"""

from __future__ import annotations

import json

import grpc

MAX_TOOLS_JSON_BYTES = 1 << 20

HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _loads(raw: str, field: str, bad_request):
    if len(raw) > MAX_TOOLS_JSON_BYTES:
        raise bad_request(
            grpc.StatusCode.OUT_OF_RANGE,
            f"{field} has {len(raw)} bytes; at most {MAX_TOOLS_JSON_BYTES} are allowed",
        )
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise bad_request(grpc.StatusCode.INVALID_ARGUMENT, f"{field} is not JSON: {e}") from None
    except RecursionError:  # json.loads gives up on deep nesting: the client's, not ours
        raise bad_request(
            grpc.StatusCode.INVALID_ARGUMENT, f"{field} nests JSON too deeply: flatten it"
        ) from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise bad_request(
            grpc.StatusCode.INVALID_ARGUMENT, f"{field} must be a JSON list of objects"
        )
    return value


def _arguments(call: dict, field: str, bad_request):
    """A call's arguments as chat templates take them: a dict when they are a JSON object.
    Arguments nested deeper than json.loads goes raise bad_request naming `field`."""
    fn = call.get("function") if isinstance(call.get("function"), dict) else {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            return args
        except RecursionError:
            raise bad_request(
                grpc.StatusCode.INVALID_ARGUMENT, f"{field} nests JSON too deeply: flatten it"
            ) from None
        return parsed if isinstance(parsed, dict) else args
    return args


def _template_calls(calls: list[dict], field: str, bad_request) -> list[dict]:
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c.get("function"), dict) else {}
        args = _arguments(c, f"{field}[{j}].function.arguments", bad_request)
        out.append(
            {
                "id": c.get("id", ""),
                "type": "function",
                "function": {"name": fn.get("name", ""), "arguments": args},
            }
        )
    return out


def hermes_call(name: str, arguments) -> str:
    return (
        "<tool_call>\n"
        + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        + "\n</tool_call>"
    )


def _hermes(conversation: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation with tools, calls and results written as Hermes' text."""
    out: list[dict] = []
    for m in conversation:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
            continue
        content = m["content"]
        if m.get("tool_calls"):
            calls = [
                hermes_call(c["function"]["name"], c["function"]["arguments"])
                for c in m["tool_calls"]
            ]
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": m["role"], "content": content})
    for m in out:
        m.pop("_tool", None)
    if tools:
        prompt = HERMES_TOOLS_PROMPT.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        )
        if out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# how a model writes its calls (router/openai/responses/tool_calls.py parses each; harmony.py
# reads gpt-oss's Harmony, its reasoning and answer too)
HARMONY = "harmony"
TOOL_FORMATS = ("hermes", "llama3_json", "mistral", "deepseek", "kimi_k2", HARMONY)
# the tokens of Harmony's messages: a vocabulary with all four is gpt-oss's (o200k_harmony)
HARMONY_TAGS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
# the tokens that start a model's calls, by format where the vocabulary names it
SECTION_TAGS = {
    "mistral": "[TOOL_CALLS]",
    "deepseek": "<｜tool▁calls▁begin｜>",
    "kimi_k2": "<|tool_calls_section_begin|>",
}
# the special tokens that start a call in those formats: they must reach the parser
TOOL_TAGS = ("<tool_call>", "<|python_tag|>", *SECTION_TAGS.values())


def tool_call_format(tokenizer) -> str:
    """How this model writes tool calls: "harmony" (gpt-oss's: HARMONY_TAGS in the vocabulary;
    its reasoning and answer are Harmony's messages too), "mistral", "deepseek" (DeepSeek-V3's
    and R1's) or "kimi_k2" (its section token in the vocabulary: SECTION_TAGS), "hermes" (its
    template writes <tool_call> blocks: Qwen2.5's, Qwen3's, Qwen3-Coder's, GLM-4.5's, Hermes'),
    "llama3_json" (Llama 3.1's and later: <|python_tag|> in the vocabulary, a template that
    takes tools, calls as bare JSON objects), else "hermes": a template that ignores tools gets
    Hermes' text."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else json.dumps(template)
    if all(tag in vocab for tag in HARMONY_TAGS):
        return HARMONY
    for fmt, tag in SECTION_TAGS.items():
        if tag in vocab:
            return fmt
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in vocab and "tools" in template:
        return "llama3_json"
    return "hermes"


def _harmony_thinking(msg: dict) -> None:
    """An assistant turn's reasoning as gpt-oss's template reads it: `thinking` (it reads no
    reasoning_content). Of a turn with calls it renders one analysis message, from `thinking`
    or else from the content, and refuses both: the content (a preamble the user saw, which it
    has no other place for) goes into the analysis after the reasoning."""
    msg["thinking"] = msg["reasoning_content"]
    if msg.get("tool_calls") and msg["content"]:
        msg["thinking"] += "\n\n" + msg["content"]
        msg["content"] = ""


def chat_conversation(chat, template: str, bad_request) -> tuple[list[dict], dict]:
    """(apply_chat_template's conversation, its extra keyword arguments: `tools` when the
    template takes them) of a pdserve.v1.ChatMessages; bad JSON raises bad_request(code, msg)."""
    tools = _loads(chat.tools_json, "chat.tools_json", bad_request) if chat.tools_json else None
    template = template if isinstance(template, str) else json.dumps(template)
    harmony = HARMONY_TAGS[1] in template  # gpt-oss's template, which writes <|channel|>
    conversation: list[dict] = []
    any_tools = bool(tools)
    for i, m in enumerate(chat.messages):
        msg = {"role": m.role, "content": m.content}
        if m.tool_calls_json:
            field = f"chat.messages[{i}].tool_calls_json"
            calls = _loads(m.tool_calls_json, field, bad_request)
            msg["tool_calls"] = _template_calls(calls, field, bad_request)
            any_tools = True
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning:
            msg["reasoning_content"] = m.reasoning
            if harmony:
                _harmony_thinking(msg)
        any_tools = any_tools or m.role == "tool"
        conversation.append(msg)
    if not any_tools:
        return conversation, {}
    if "tools" in template and "tool_calls" in template:
        return conversation, ({"tools": tools} if tools else {})
    try:
        return _hermes(conversation, tools), {}
    except RecursionError:  # JSON that json.loads just read may be too deep to write back out
        raise bad_request(
            grpc.StatusCode.INVALID_ARGUMENT,
            "chat.tools_json or a tool call's arguments nest JSON too deeply: flatten them",
        ) from None
