"""OpenAI's Conversations API: a conversation's items kept in the router's store, so an agent
(the OpenAI Agents SDK's OpenAIConversationsSession, say) names a conversation in each
/v1/responses request instead of sending its history. A response created with `conversation`
reads the conversation's items before its input, and when it ends (completed or incomplete) its
input and output items are added to the conversation (router/openai/responses_api.py `Keep`).

Routes: POST /v1/conversations (at most 20 first items, metadata), GET, POST (new metadata) and
DELETE /v1/conversations/{id}; GET /v1/conversations/{id}/items (OpenAI's list: limit, order,
after), POST (at most 20 items added), GET and DELETE /v1/conversations/{id}/items/{item_id}.
Items are those /v1/responses takes as input (messages, function calls and their outputs,
reasoning), each given an id. Conversations share the store's bound with stored responses
(router/openai/responses/store.py: least recently used evicted first; a restart forgets them),
each at most MAX_CONVERSATION_ITEMS items and 1/CONVERSATION_SHARE of the store's bytes (a 400
conversation_too_large past them), and belong to the API key that created them, as stored
responses do. The routes are declared on `router`, which build_app (router/openai/app.py)
includes; they keep no state of their own.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import Field, field_validator

from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.protocol import _field_names, _Strict
from pdserve.router.openai.responses.store import (
    CONVERSATION_SHARE,
    MAX_CONVERSATION_ITEMS,
    Conversation,
)
from pdserve.router.openai.responses_api import (
    InputItem,
    Metadata,
    _check_items,
    conversation_not_found,
    fetched_links,
    items_of,
    page_of,
)
from pdserve.router.openai.state import state_of

router = APIRouter()

MAX_ADDED_ITEMS = 20  # OpenAI's bound on the items one call creates


class ConversationCreate(_Strict):
    """POST /v1/conversations."""

    items: Annotated[list[InputItem], Field(max_length=MAX_ADDED_ITEMS)] | None = None
    metadata: Metadata | None = None

    _items = field_validator("items", mode="before")(classmethod(lambda cls, v: _check_items(v)))


class ConversationUpdate(_Strict):
    """POST /v1/conversations/{id}."""

    metadata: Metadata


class ItemsCreate(_Strict):
    """POST /v1/conversations/{id}/items."""

    items: Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ADDED_ITEMS)]

    _items = field_validator("items", mode="before")(classmethod(lambda cls, v: _check_items(v)))


CONVERSATION_FIELDS = _field_names(ConversationCreate, ItemsCreate)


def _found(request: Request, conversation_id: str) -> Conversation:
    front = state_of(request)
    front.authorize(request)
    found = front.responses.conversation(conversation_id, front.owner(request))
    if found is None:
        raise conversation_not_found(conversation_id)
    return found


def _too_large(store) -> ApiError:
    return ApiError(
        400,
        f"the conversation would hold more than {MAX_CONVERSATION_ITEMS} items or "
        f"{store.max_conversation_bytes} bytes (1/{CONVERSATION_SHARE} of the router's "
        "store, router.responses_store_mb): delete some of its items, or start a new one",
        code="conversation_too_large",
    )


@router.post("/v1/conversations")
async def create(request: Request):
    front = state_of(request)
    body, _ = await front.parse(request, ConversationCreate, CONVERSATION_FIELDS)
    if not front.responses.enabled:
        raise ApiError(
            400,
            "conversations are not kept on this deployment (router.responses_store_mb is 0)",
            code="not_supported",
        )
    conversation = Conversation(front.owner(request), int(time.time()), body.metadata or {}, [])
    items = items_of(body.items or [])
    await fetched_links(front, items, "items")  # (images by link: the files are kept)
    conversation.add(items)
    key = f"conv_{uuid.uuid4().hex}"
    if not front.responses.create_conversation(key, conversation):
        raise _too_large(front.responses)
    return conversation.card(key)


@router.get("/v1/conversations/{conversation_id}")
async def retrieve(request: Request, conversation_id: str):
    return _found(request, conversation_id).card(conversation_id)


@router.post("/v1/conversations/{conversation_id}")
async def update(request: Request, conversation_id: str):
    _found(request, conversation_id)
    front = state_of(request)
    body, _ = await front.parse(request, ConversationUpdate, CONVERSATION_FIELDS | {"metadata"})
    found = _found(request, conversation_id)  # again: it may be gone while the body was read
    found.metadata, old = body.metadata, found.metadata
    if not front.responses.resize(conversation_id, found):
        found.metadata = old
        raise _too_large(front.responses)
    return found.card(conversation_id)


@router.delete("/v1/conversations/{conversation_id}")
async def delete(request: Request, conversation_id: str):
    _found(request, conversation_id)
    front = state_of(request)
    front.responses.delete(conversation_id, front.owner(request))
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


@router.get("/v1/conversations/{conversation_id}/items")
async def list_items(request: Request, conversation_id: str):
    found = _found(request, conversation_id)
    return page_of(found.ids, found.item, request.query_params)  # decodes the page's items only


@router.post("/v1/conversations/{conversation_id}/items")
async def add_items(request: Request, conversation_id: str):
    _found(request, conversation_id)  # a stranger's or unknown one: refused before the body
    front = state_of(request)
    body, _ = await front.parse(request, ItemsCreate, CONVERSATION_FIELDS)
    added = items_of(body.items)
    await fetched_links(front, added, "items")  # (images by link: the files are kept)
    # looked up again: deleted or evicted while the body was read (or its links fetched), it
    # gets no items (a 404)
    found = _found(request, conversation_id)
    if not front.responses.extend(conversation_id, found, added):
        raise _too_large(front.responses)
    return {
        "object": "list",
        "data": added,
        "first_id": added[0]["id"],
        "last_id": added[-1]["id"],
        "has_more": False,
    }


def _item(found: Conversation, item_id: str) -> int:
    """The index of the conversation's first item with id `item_id` (its ids kept apart: no
    item is decoded to find it)."""
    if item_id in found.ids:
        return found.ids.index(item_id)
    raise ApiError(404, f"Item with id {item_id[:200]!r} not found", code="not_found")


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def retrieve_item(request: Request, conversation_id: str, item_id: str):
    found = _found(request, conversation_id)
    return found.item(_item(found, item_id))


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(request: Request, conversation_id: str, item_id: str):
    found = _found(request, conversation_id)
    found.remove(_item(found, item_id))
    state_of(request).responses.resize(conversation_id, found)
    return found.card(conversation_id)
