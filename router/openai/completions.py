"""POST /v1/completions: a prompt, or a batch of them (text or token ids), to the router's gRPC
Generate, one call per prompt (router/openai/generate.py runs them and writes the response).

The body is router/openai/protocol.py's CompletionRequest; a text prompt longer than
max_model_len tokens can hold is refused here, before a gRPC message that may exceed the gRPC
port's size limit. A `suffix` makes each text prompt a fill-in-the-middle prompt
(router/openai/fim.py). use_beam_search runs vLLM's beam search on the same requests instead
(router/openai/beam.py). The route is declared on `router`, which build_app (router/openai/app.py)
includes; it keeps no state of its own.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.beam import beam_generate
from pdserve.router.openai.errors import ApiError
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
    if body.suffix is not None:
        prompts = _filled_in(front, body, prompts)
        sampling.stop_token_ids.extend(front.fim.stop_token_ids)
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
    if body.use_beam_search:  # vLLM's beam search, n the beam width (router/openai/beam.py)
        return await beam_generate(request, gens, metadata, body, chat=False)
    return await generate(request, gens, metadata, body, chat=False)


def _filled_in(front, body: CompletionRequest, prompts: list) -> list[str]:
    """The fill-in-the-middle prompts of a completion with a suffix (router/openai/fim.py), or a
    400 naming `suffix` where the model, `echo` or a prompt of token ids cannot take one."""
    fim = front.fim
    if fim is None:
        why = "this model's vocabulary has no fill-in-the-middle tokens (a code model's)"
    elif body.echo:
        why = "echo cannot be combined with it (the answer is the middle alone)"
    elif not all(isinstance(p, str) for p in prompts):
        why = "it needs the prompt as text, not token ids"
    else:
        front.check_prompt_size([body.suffix], "suffix")
        return [fim.prompt(p, body.suffix) for p in prompts]
    raise ApiError(400, f"suffix is not served here: {why}", param="suffix")
