"""POST /v1/completions: a prompt, or a batch of them (text or token ids), to the router's gRPC
Generate, one call per prompt (router/openai/generate.py runs them and writes the response).

The body is router/openai/protocol.py's CompletionRequest; a text prompt longer than
max_model_len tokens can hold is refused here, before a gRPC message that may exceed the gRPC
port's size limit. The route is declared on `router`, which build_app (router/openai/app.py)
includes; it keeps no state of its own.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.generate import generate
from pdserve.router.openai.protocol import CompletionRequest, sampling_params
from pdserve.router.openai.state import state_of

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    front = state_of(request)
    body, metadata = await front.parse(request, CompletionRequest)
    prompts = body.prompts()
    for text in (p for p in prompts if isinstance(p, str)):
        front.check_prompt_size([text], "prompt")
    sampling = sampling_params(body, body.max_new_tokens())
    gens = []
    for prompt in prompts:
        gen = pdserve_pb2.GenerateRequest(
            model=body.model or "",
            sampling=sampling,
            priority=body.priority,
            return_prompt_token_ids=bool(body.return_token_ids),
        )
        if body.truncate_prompt_tokens is not None:
            gen.truncate_prompt_tokens = body.truncate_prompt_tokens
        if isinstance(prompt, str):
            gen.text = prompt
        else:
            gen.token_ids.ids.extend(prompt)
        gens.append(gen)
    return await generate(request, gens, metadata, body, chat=False)
