"""POST /v1/embeddings (OpenAI's and vLLM's shapes): each input's embedding, through the router's
gRPC Embed (router/service.py), which runs them on the prefill pool (the colocated workers in a
colocated deployment) with the deployment's pooling (router.embedding_pooling: the final hidden
state of the last token by default, L2-normalised unless router.embedding_normalize is false).

    {"input": "text" | ["text", ...] | [1, 2, 3] | [[1, 2], [3]],   at most MAX_EMBED_INPUTS,
     "model"?, "encoding_format"?: "float" | "base64", "dimensions"?, "user"?, "priority"?}
    -> {"id", "object": "list", "created", "model",
        "data": [{"object": "embedding", "index", "embedding": [floats] | base64}],
        "usage": {"prompt_tokens", "total_tokens"}}

base64 is the float32 vector's little-endian bytes (what the openai client decodes). `dimensions`
cuts a Matryoshka model's vectors to that width, normalised again (the router checks the model is
one and the width allowed, else a 400 naming it, as vLLM refuses it). `user` is accepted as a
label. `model` may name a LoRA adapter (router/lora.py), which every input then runs under, and
the answer's `model` is the name sent (the served model's id when none is). A bad input is a 400
naming `input`; every input must fit max_model_len - 1 tokens, as a prompt must, and a text in
bytes what that many tokens can hold (FrontState.check_prompt_size), unless
truncate_prompt_tokens is set: then each input keeps its first k tokens after tokenizing (vLLM's
truncation for pooling models: router/service.py), and a text is bounded by the request's size
only (FrontState.check_request_size). The route is declared on `router`, which
build_app (router/openai/app.py) includes; it keeps no state of its own.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import Field, StrictInt, StrictStr

from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.generate import _cancel_on_disconnect, _from_router
from pdserve.router.openai.protocol import (
    Priority,
    ShortStr,
    TruncatePromptTokens,
    _field_names,
    _Strict,
)
from pdserve.router.openai.state import state_of
from pdserve.router.service import MAX_EMBED_INPUTS

router = APIRouter()

TokenId = Annotated[StrictInt, Field(ge=0, lt=1 << 32)]
Texts = Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_EMBED_INPUTS)]
Ids = Annotated[list[TokenId], Field(min_length=1)]
IdLists = Annotated[list[Ids], Field(min_length=1, max_length=MAX_EMBED_INPUTS)]


class EmbeddingRequest(_Strict):
    input: StrictStr | Texts | Ids | IdLists
    model: ShortStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    # a Matryoshka model's embeddings cut to this width (the router checks it may be: 400 naming
    # it otherwise)
    dimensions: Annotated[StrictInt, Field(ge=1, lt=1 << 32)] | None = None
    user: ShortStr | None = None
    priority: Priority = 0  # as chat's (router/openai/protocol.py)
    # vLLM's: each input keeps only its last k tokens (-1: as many as max_model_len holds)
    truncate_prompt_tokens: TruncatePromptTokens | None = None

    def inputs(self) -> list[pdserve_pb2.EmbedInput]:
        """The inputs as the gRPC API takes them, in order."""
        return embed_inputs(self.input)


def embed_inputs(one) -> list[pdserve_pb2.EmbedInput]:
    """An `input` field (a text, texts, token ids or lists of them) as EmbedInput messages."""
    if isinstance(one, str):
        return [pdserve_pb2.EmbedInput(text=one)]
    if all(isinstance(x, int) for x in one):
        return [pdserve_pb2.EmbedInput(token_ids=pdserve_pb2.TokenIds(ids=one))]
    if all(isinstance(x, str) for x in one):
        return [pdserve_pb2.EmbedInput(text=t) for t in one]
    return [pdserve_pb2.EmbedInput(token_ids=pdserve_pb2.TokenIds(ids=ids)) for ids in one]


EMBEDDING_FIELDS = _field_names(EmbeddingRequest)


def check_texts(front, body, inputs: list[pdserve_pb2.EmbedInput], param: str) -> None:
    """Refuses (400, naming `param` and which input) a text longer in bytes than max_model_len
    tokens can hold, each input on its own; none where the body truncates its inputs, whose
    texts the router tokenizes whole and cuts (the request's size bounds them)."""
    if body.truncate_prompt_tokens is not None:
        return
    for i, one in enumerate(inputs):
        if one.HasField("text"):
            front.check_prompt_size([one.text], f"{param}[{i}]" if len(inputs) > 1 else param)


def encode(values, encoding_format: str):
    """One vector as the response carries it: floats, or base64 of float32 little-endian."""
    if encoding_format == "float":
        return list(values)
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    front = state_of(request)
    body, metadata = await front.parse(request, EmbeddingRequest, EMBEDDING_FIELDS)
    front.check_model(body.model)
    inputs = body.inputs()
    check_texts(front, body, inputs, "input")
    call = pdserve_pb2.EmbedRequest(
        request_id=f"http-{uuid.uuid4().hex}",
        model=body.model or "",
        priority=body.priority,
    )
    call.inputs.extend(inputs)
    if body.truncate_prompt_tokens is not None:
        call.truncate_prompt_tokens = body.truncate_prompt_tokens
    if body.dimensions is not None:
        call.dimensions = body.dimensions
    front.check_request_size(call, "input")
    rpc = front.stub.Embed(call, metadata=metadata)
    # a client that disconnects cancels the call: the router cancels the worker's, which aborts
    # the inputs still in its engine
    watcher = asyncio.create_task(_cancel_on_disconnect(request, rpc))
    try:
        reply = await _from_router(rpc, watcher)
    except ApiError as err:
        if err.status == 400 and err.message.startswith("inputs"):
            err.message, err.param = "input" + err.message[len("inputs") :], "input"
        elif err.status == 400 and err.message.startswith("priority="):
            err.param = "priority"
        elif err.status == 400 and err.message.startswith("dimensions"):
            err.param = "dimensions"
        raise
    finally:
        watcher.cancel()
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": body.model or front.settings.model_id,
        "data": [
            {
                "object": "embedding",
                "index": e.index,
                "embedding": encode(e.values, body.encoding_format),
            }
            for e in reply.embeddings
        ],
        "usage": {"prompt_tokens": reply.prompt_tokens, "total_tokens": reply.prompt_tokens},
    }
