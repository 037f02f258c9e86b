"""The HTTP front's endpoints beyond generation (router/http_api.py's build_app adds them), with
vLLM's request and response shapes:

    POST /tokenize        {"prompt"} or {"messages", chat template fields}  ->  {"count",
                          "max_model_len", "tokens", "token_strs"}: the ids Generate would run
                          (the router's own PromptEncoder, router/text.py, on its own thread)
    POST /detokenize      {"tokens"}  ->  {"prompt"}
    GET  /version         {"version"}: pdserve's (no key needed, as vLLM's)
    GET  /v1/models/{id}  the served model's card; 404 (model_not_found) for another id

and the OpenAPI document's request bodies (document_bodies: FastAPI serves the document at
/openapi.json and its page at /docs).

Each checks the client's key as every other endpoint (but /version), and validates its body with
router/openai_schema.py's models: a bad field is a 400 naming it. A body's `model`, when set,
must be the served one (404 otherwise, as a generation request gets). No state of their own.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

import grpc
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi

from pdserve import __version__
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai_format import ApiError
from pdserve.router.openai_schema import DetokenizeRequest, TokenizeRequest
from pdserve.router.openai_tools import tool_calls_json, tools_json
from pdserve.router.text import BadRequest, PromptEncoder

if TYPE_CHECKING:
    from pdserve.router.http_server import HttpFront


def model_card(m, created: int) -> dict:
    return {
        "id": m.id,
        "object": "model",
        "created": created,
        "owned_by": "pdserve",
        "root": m.id,
        "max_model_len": m.max_model_len,
    }


def chat_messages(body) -> pdserve_pb2.ChatMessages:
    """The gRPC chat of an OpenAI chat body (or a /tokenize one): messages and template fields."""
    chat = pdserve_pb2.ChatMessages(
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
    )
    for m in body.messages:
        msg = chat.messages.add(role=m.template_role(), content=m.text())
        if m.tool_calls:
            msg.tool_calls_json = tool_calls_json(m.tool_calls)
        if m.tool_call_id is not None:
            msg.tool_call_id = m.tool_call_id
    if getattr(body, "tools", None):
        chat.tools_json = tools_json(body.tools)
    if body.chat_template_kwargs:
        chat.chat_template_kwargs_json = json.dumps(body.chat_template_kwargs)
    return chat


def document_bodies(app: FastAPI, bodies: dict[str, type]) -> None:
    """The OpenAPI document (GET /openapi.json, FastAPI's) with the request body of each POST
    path in `bodies` described by its pydantic model: the handlers read raw requests (to bound
    them before parsing), so FastAPI cannot see them itself."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            ref = {"$ref": f"#/components/schemas/{model.__name__}"}
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": ref}},
            }
        app.openapi_schema = doc
        return doc

    app.openapi = openapi


def add_extra_routes(app: FastAPI, front: HttpFront, authorize, parse) -> None:
    """authorize(request) checks the key and returns the gRPC metadata; parse(request, model)
    reads and validates the body (router/http_api.py's)."""
    s = front.settings
    encoder = s.encoder
    if encoder is None:  # a front built without the router's (tests): one of its own
        encoder = PromptEncoder(s.tokenizer, s.max_model_len or (1 << 20))

    def check_model(model: str | None) -> None:
        if model is not None and model != s.model_id:
            raise ApiError(
                404,
                f"model {model[:200]!r} is not served here: use {s.model_id!r} (or leave model "
                f"unset)",
                param="model",
                code="model_not_found",
            )

    async def encode(param: str, fn, *args) -> list[int]:
        try:  # the encoder waits on its own thread: not on the event loop
            return await asyncio.to_thread(fn, *args)
        except BadRequest as e:
            status = 400 if e.code != grpc.StatusCode.UNAVAILABLE else 503
            raise ApiError(status, f"{param}: {e.message}", param=param) from None

    @app.get("/version")
    async def version():
        return {"version": __version__}

    async def served(request: Request) -> list:
        """The router's models (gRPC ListModels), for a caller whose key checks out."""
        metadata = authorize(request)
        try:
            reply = await front.stub.ListModels(
                pdserve_pb2.ListModelsRequest(), metadata=metadata, timeout=30
            )
        except grpc.RpcError as e:
            raise ApiError.from_grpc(e) from None
        return list(reply.models)

    @app.get("/v1/models")
    async def models(request: Request):
        created = int(time.time())
        return {"object": "list", "data": [model_card(m, created) for m in await served(request)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        for m in await served(request):
            if m.id == model_id:
                return model_card(m, int(time.time()))
        raise ApiError(
            404,
            f"the model {model_id[:200]!r} does not exist here (GET /v1/models lists them)",
            param="model",
            code="model_not_found",
        )

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body, _ = await parse(request, TokenizeRequest)
        check_model(body.model)
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await encode("prompt", encoder.tokenize_text, body.prompt, special)
        else:
            special = bool(body.add_special_tokens)
            ids = await encode("messages", encoder.tokenize_chat, chat_messages(body), special)
        strs = None
        if body.return_token_strs:
            strs = s.tokenizer.convert_ids_to_tokens(ids)
        return {
            "count": len(ids),
            "max_model_len": s.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body, _ = await parse(request, DetokenizeRequest)
        check_model(body.model)
        vocab = len(s.tokenizer)
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise ApiError(
                400,
                f"tokens: ids must be below the vocabulary size {vocab}, got {bad[:3]}",
                param="tokens",
                code="invalid_value",
            )
        text = await asyncio.to_thread(s.tokenizer.decode, body.tokens)
        return {"prompt": text}
