"""OpenAI's whole (non-streaming) responses for the HTTP front, as a pure function of the
router's gRPC messages: the choices of every sequence, with completions' echo (the prompt before
the completion; max_tokens 0: the prompt alone, its generated token dropped, as vLLM), the
logprobs of logprobs.py (a prompt's built once for all n choices of it), a chat's tool calls
(tool_calls.py), vLLM's return_token_ids (the prompt's ids from its call's first response, each
choice's own), the usage and the `pdserve` extension (parts.py). The streamed form is
stream.py's. No server state lives here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.protocol import NamedToolChoice
from pdserve.router.openai.responses.logprobs import (
    chat_logprobs,
    check_logprobs,
    check_prompt,
    completion_logprobs,
    echo_logprobs,
    joined,
    prompt_logprobs_field,
)
from pdserve.router.openai.responses.parts import extension, finish_reason, stop_reason, usage
from pdserve.router.openai.responses.reasoning import ChatText, Reading
from pdserve.router.openai.responses.tool_calls import ToolCallParser, join_events


@dataclass
class Choice:
    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list = field(default_factory=list)  # pdserve_pb2.TopLogprobs, one per token
    counts: list[int] = field(default_factory=list)  # each delta's tokens (its text: `text`)
    reasoning_tokens: int = 0  # a reasoning model's chat: the output's tokens of reasoning
    finish: pdserve_pb2.Finish | None = None
    # return_token_ids: the prompt's ids, on the choice whose response came first in its call
    prompt_ids: list[int] | None = None


def collect_choices(responses) -> dict[int, Choice]:
    choices: dict[int, Choice] = {}
    for r in responses:
        if r.HasField("delta"):
            d = r.delta
            c = choices.setdefault(d.index, Choice(d.index))
            c.text.append(d.text)
            c.counts.append(len(d.token_ids))
            c.token_ids.extend(d.token_ids)
            c.logprobs.extend(d.logprobs)
            c.tops.extend(d.top_logprobs)
            if d.prompt_token_ids:
                c.prompt_ids = list(d.prompt_token_ids)
        elif r.HasField("finish"):
            c = choices.setdefault(r.finish.index, Choice(r.finish.index))
            c.finish = r.finish
            if r.finish.prompt_token_ids and c.prompt_ids is None:
                c.prompt_ids = list(r.finish.prompt_token_ids)
    return choices


def prompt_ids_of(choices: dict[int, Choice], n: int) -> dict[int, list[int]]:
    """return_token_ids: each prompt's token ids (choice i * n + j is prompt i's), from the
    response of its call that carried them."""
    out: dict[int, list[int]] = {}
    for i, c in choices.items():
        if c.prompt_ids is not None:
            out.setdefault(i // n, c.prompt_ids)
    return out


def echo_text(body, index: int, text_of) -> str:
    """Choice `index`'s prompt as text (a token id prompt decoded), for echo."""
    prompt = body.prompts()[index // body.n]
    return prompt if isinstance(prompt, str) else text_of.text(prompt)


def request_usage(finishes, body) -> dict:
    """usage(); with max_tokens 0 (echo alone) the one token generated per sequence is dropped;
    with a predicted output, OpenAI's completion_tokens_details of it."""
    out = usage(finishes, body.n)
    if getattr(body, "max_tokens", None) == 0:
        out["completion_tokens"] = 0
        out["total_tokens"] = out["prompt_tokens"]
    if getattr(body, "prediction", None) is not None:
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(f.usage.accepted_prediction_tokens for f in finishes),
            "rejected_prediction_tokens": sum(f.usage.rejected_prediction_tokens for f in finishes),
        }
    return out


def with_reasoning_tokens(used: dict, tokens: int) -> dict:
    """A reasoning model's chat usage: OpenAI's completion_tokens_details.reasoning_tokens."""
    used.setdefault("completion_tokens_details", {})["reasoning_tokens"] = tokens
    return used


@dataclass
class PromptParts:
    """What a completion's choices of one prompt share, built once for all n of them: the
    prompt's text (echo), its logprobs as echo shows them, and vLLM's prompt_logprobs field."""

    head: str = ""
    echo: dict | None = None
    prompt_logprobs: list | None = None


def prompt_parts(choices: dict[int, Choice], body, text_of) -> dict[int, PromptParts]:
    """Each prompt's PromptParts (choice i * n + j is prompt i's): its logprobs come from the
    first of its choices' Finish messages that carries them, and are refused (check_prompt)
    when none does."""
    out: dict[int, PromptParts] = {}
    wants_echo = body.wants_logprobs and body.echo
    for i in sorted(choices):
        p = i // body.n
        if p in out:
            continue
        parts = out[p] = PromptParts(echo_text(body, i, text_of) if body.echo else "")
        if not wants_echo and body.prompt_logprobs is None:
            continue
        mine = [choices[j].finish for j in range(p * body.n, (p + 1) * body.n) if j in choices]
        finish = next((f for f in mine if f.prompt_token_ids), mine[0])
        check_prompt(finish)
        if wants_echo:
            parts.echo = echo_logprobs(finish, text_of, body.num_top())
        if body.prompt_logprobs is not None:
            parts.prompt_logprobs = prompt_logprobs_field(finish, text_of, body.prompt_logprobs)
    return out


def _completion_choice(
    c: Choice, body, text_of, prompt_ids: dict, shared: PromptParts, aborts: bool = False
) -> dict:
    """Choice `c` of a completion; `shared` what it shares with the other choices of its
    prompt (prompt_parts)."""
    echo_only = body.max_tokens == 0
    head = shared.head
    text = head + ("" if echo_only else "".join(c.text))
    lp = None
    if body.wants_logprobs:
        k = body.num_top()
        parts = []
        if body.echo:
            parts.append(shared.echo)
        if not echo_only:
            check_logprobs(c.token_ids, c.logprobs, c.tops, k)
            parts.append(
                completion_logprobs(c.token_ids, c.logprobs, text_of, len(head), c.tops, k)
            )
        lp = parts[0] if len(parts) == 1 else joined(*parts)
    out = {
        "index": c.index,
        "text": text,
        "logprobs": lp,
        "finish_reason": finish_reason(c.finish, aborts),
        "stop_reason": stop_reason(c.finish),
    }
    if body.return_token_ids:  # vLLM's: with echo, the prompt's ids lead, as its text does
        prompt = prompt_ids[c.index // body.n]
        generated = [] if echo_only else c.token_ids
        out["token_ids"] = (prompt if body.echo else []) + generated
        out["prompt_token_ids"] = prompt
    if body.prompt_logprobs is not None:
        out["prompt_logprobs"] = shared.prompt_logprobs
    return out


def chat_text(body, reading: Reading) -> ChatText | None:
    """A chat sequence's text parser (reasoning.py's ChatText); None when the text is content
    as it is: no reasoning split (reading.reasoning None) and no tools."""
    mode = body.tool_mode()
    if mode == "none" and reading.reasoning is None:
        return None
    tools = None
    if mode != "none":
        single = body.parallel_tool_calls is False
        declared = [t.model_dump() for t in body.tools or ()]
        choice = body.tool_choice
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        tools = ToolCallParser(
            forced=mode == "forced", single=single, fmt=reading.tools, tools=declared, name=named
        )
    return ChatText(reading.reasoning, tools, keep=body.include_reasoning)


def _chat_choice(
    c: Choice, body, text_of, prompt_ids: dict, reading=None, aborts: bool = False
) -> dict:
    reason = finish_reason(c.finish, aborts)
    lp = None
    if body.logprobs:
        check_logprobs(c.token_ids, c.logprobs, c.tops, body.num_top())
        lp = chat_logprobs(c.token_ids, c.logprobs, text_of, c.tops, body.num_top())
    message: dict = {"role": "assistant", "content": "".join(c.text)}
    reading = reading or Reading()
    parser = chat_text(body, reading)
    if parser is not None:  # reasoning split off and tool calls parsed out (reasoning.py)
        events = []
        at = 0
        for text, n in zip(c.text, c.counts, strict=True):
            ids = c.token_ids[at : at + n]
            at += n
            events += parser.feed(text, n, lambda ids=ids: [text_of.text([t]) for t in ids])
        events += parser.finish()
        c.reasoning_tokens = parser.reasoning_tokens
        content, calls = join_events(events)
        message = {"role": "assistant", "content": content}
        if reading.reasoning is not None:
            thought = "".join(e["reasoning"] for e in events if "reasoning" in e) or None
            message.update(reasoning=thought, reasoning_content=thought)
        if parser.tools is not None:
            message["tool_calls"] = calls
        if calls and reason == "stop":
            reason = "tool_calls"
    return {
        "index": c.index,
        "message": message,
        "logprobs": lp,
        "finish_reason": reason,
        "stop_reason": stop_reason(c.finish),
        **({"token_ids": c.token_ids} if body.return_token_ids else {}),
    }


def whole_response(
    responses,
    body,
    chat: bool,
    model_id: str,
    request_id: str,
    text_of,
    reading=None,
    aborts: bool = False,
) -> dict:
    """The non-streaming response body; a chat's text read as `reading` (reasoning.py) says;
    `aborts`: an aborted sequence is finish_reason "abort" (parts.finish_reason)."""
    reading = reading or Reading()
    choices = collect_choices(responses)
    finishes = [c.finish for c in choices.values() if c.finish is not None]
    missing = [i for i, c in choices.items() if c.finish is None]
    if missing or not finishes:
        raise ApiError(500, f"sequences {missing} ended without a Finish", "server_error")
    order = sorted(choices)
    prompt_ids = prompt_ids_of(choices, body.n) if body.return_token_ids else {}
    if body.return_token_ids and len(prompt_ids) < len(finishes) // body.n:
        raise ApiError(500, "the router sent no prompt token ids", "server_error")
    if chat:
        out = [_chat_choice(choices[i], body, text_of, prompt_ids, reading, aborts) for i in order]
    else:
        prompts = prompt_parts(choices, body, text_of)  # once per prompt, not per choice
        out = [
            _completion_choice(choices[i], body, text_of, prompt_ids, prompts[i // body.n], aborts)
            for i in order
        ]
    used = request_usage(finishes, body)
    if chat and reading.reasoning is not None:
        with_reasoning_tokens(used, sum(c.reasoning_tokens for c in choices.values()))
    suffix = request_id.removeprefix("http-")
    extra = {"prompt_token_ids": prompt_ids[0]} if chat and body.return_token_ids else {}
    return {
        "id": f"chatcmpl-{suffix}" if chat else f"cmpl-{suffix}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_id,
        "choices": out,
        "usage": used,
        "system_fingerprint": None,
        **extra,
        "pdserve": extension(finishes, request_id),
    }
