"""The HTTP front's tokenizer endpoints, with vLLM's request and response shapes:

    POST /tokenize        {"prompt"} or {"messages", chat template fields, "tools"}  ->
                          {"count", "max_model_len", "tokens", "token_strs"}: the ids Generate
                          would run for a chat completion with the same messages, fields and
                          tools (the router's own PromptEncoder, router/text.py, on its own
                          thread); an empty prompt gives the tokenizer's special tokens (a BOS),
                          as vLLM's does, though Generate refuses an empty text
    POST /detokenize      {"tokens"}  ->  {"prompt"}

Each checks the client's key as every other endpoint, and validates its body with
router/openai/protocol.py's models: a bad field is a 400 naming it. A body's `model`, when set,
must be the served one (404 otherwise, as a generation request gets). The routes are declared on
`router`, which build_app (router/openai/app.py) includes; they keep no state of their own.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.protocol import DetokenizeRequest, TokenizeRequest, chat_messages
from pdserve.router.openai.state import state_of

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request):
    front = state_of(request)
    body, _ = await front.parse(request, TokenizeRequest)
    front.check_model(body.model)
    encoder = front.encoder
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await front.encode("prompt", encoder.tokenize_text, body.prompt, special)
    else:
        special = bool(body.add_special_tokens)
        ids = await front.encode("messages", encoder.tokenize_chat, chat_messages(body), special)
    strs = None
    if body.return_token_strs:
        strs = front.settings.tokenizer.convert_ids_to_tokens(ids)
    return {
        "count": len(ids),
        "max_model_len": front.settings.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


@router.post("/detokenize")
async def detokenize(request: Request):
    front = state_of(request)
    body, _ = await front.parse(request, DetokenizeRequest)
    front.check_model(body.model)
    tokenizer = front.settings.tokenizer
    vocab = len(tokenizer)
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise ApiError(
            400,
            f"tokens: ids must be below the vocabulary size {vocab}, got {bad[:3]}",
            param="tokens",
            code="invalid_value",
        )
    text = await asyncio.to_thread(tokenizer.decode, body.tokens)
    return {"prompt": text}
