"""POST /v1/chat/completions: messages, rendered by the model's chat template on the router
(router/text.py), to the router's gRPC Generate (router/openai/generate.py runs the call and
writes the response).

The body is router/openai/protocol.py's ChatCompletionRequest; messages longer than
max_model_len tokens can hold are refused here. Unset max_tokens means until the sequence fills
the context (OpenAI's and vLLM's chat default). With tools in "auto" mode and a tokenizer whose
<tool_call> is a special token, special tokens are kept so the tags reach the tool-call parser.
use_beam_search runs vLLM's beam search on the same request instead (router/openai/beam.py).
The route is declared on `router`, which build_app (router/openai/app.py) includes; it keeps no
state of its own.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import ValidationError

from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.beam import beam_generate
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.generate import generate
from pdserve.router.openai.media import fetch_images
from pdserve.router.openai.protocol import ChatCompletionRequest, chat_messages, sampling_params
from pdserve.router.openai.state import state_of

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    front = state_of(request)
    body, metadata = await front.parse(request, ChatCompletionRequest)
    await fetch_images(body.messages, front.settings.allowed_media_domains)  # (image links)
    if body.use_beam_search:  # vLLM's beam search, n the beam width (router/openai/beam.py)
        return await beam_generate(request, [chat_request(front, body)], metadata, body, chat=True)
    return await generate(request, [chat_request(front, body)], metadata, body, chat=True)


def validated_chat(body: dict) -> ChatCompletionRequest:
    """The chat completion another API's body describes (/v1/responses', /v1/messages'), checked
    as a chat body; ApiError 400 when it is not one."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors(include_input=False, include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(
            400,
            f"the request is not one this server can run as a chat ({where}: {first['msg']})",
            code="invalid_value",
        ) from None


def chat_request(front, body: ChatCompletionRequest, param: str = "messages"):
    """The gRPC GenerateRequest of a chat body (also /v1/responses' input, read as a chat);
    messages longer than max_model_len tokens can hold are refused, naming `param`."""
    texts = [t for m in body.messages for t in (m.role, m.text(), m.thought() or "")]
    front.check_prompt_size(texts, param)
    # unset: until the sequence fills the context (OpenAI's and vLLM's chat default)
    most = body.max_new_tokens() or front.settings.max_model_len or None
    gen = pdserve_pb2.GenerateRequest(
        model=body.model or "",
        sampling=sampling_params(body, most),
        priority=body.priority,
        return_prompt_token_ids=bool(body.return_token_ids),
    )
    tags = front.think_special or body.tool_mode() == "auto" and front.tags_special
    if tags and body.skip_special_tokens is None:
        gen.sampling.skip_special_tokens = False  # the tags must reach the parsers
    gen.chat.CopyFrom(chat_messages(body))
    if body.truncate_prompt_tokens is not None:
        gen.truncate_prompt_tokens = body.truncate_prompt_tokens
    if body.prediction is not None:
        gen.prediction = body.prediction.text()
        front.check_prompt_size([gen.prediction], "prediction")
    return gen
