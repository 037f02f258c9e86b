"""The HTTP front's stored Responses (OpenAI's Responses API with `store`): what a later request
needs to continue a conversation by `previous_response_id`, and what GET /v1/responses/{id},
its /input_items and DELETE read (router/openai/responses_api.py serves them).

A stored response is its Response object as answered, and the conversation's items up to and
including its output (earlier responses' items first, then this request's input items, then its
output items), kept as compact JSON bytes so that the store's bound is the memory it takes. Each
response holds its whole conversation, so a chain's later responses are its larger ones, and any of
them can be continued or deleted alone. The store keeps at most `max_bytes`: a new response evicts
the least recently used ones (stored or read) until it fits, and one larger than the whole store is
not kept. It lives in the router process's memory only: a restart forgets everything. Conversations
of the Conversations API (router/openai/conversations_api.py) live in the same store, under the same
bound, each item kept as its JSON bytes; one conversation holds at most MAX_CONVERSATION_ITEMS
items and 1/CONVERSATION_SHARE of the store's bytes.

A background response in progress (`running`) is kept apart until it ends, never evicted, at most
MAX_RUNNING at once; `stop` cancels them when the front stops. With API keys, a response belongs to
the key that created it (a hash of the key, never the key); another key gets "not found" for it,
exactly as for an id that never existed. Ids are 128 random bits. FrontState
(router/openai/state.py) makes one store per app; every call runs on the HTTP front's event loop, so
nothing here locks.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass, field

# background responses in progress at once, at most (each holds one call of the router's)
MAX_RUNNING = 1024
# one conversation's items at most, and its bytes at most 1/CONVERSATION_SHARE of the store's
# (router.responses_store_mb): one client's conversation cannot evict every other key's entries,
# and a read that decodes all of its items (a response that continues it) is bounded
MAX_CONVERSATION_ITEMS = 10_000
CONVERSATION_SHARE = 4


def _json(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Stored:
    """One stored response: its owner (None without API keys), its Response object, and its
    conversation's items, of which items[first_input:end_input] are the request's own input."""

    owner: str | None
    response_json: bytes
    items_json: bytes
    first_input: int
    end_input: int

    @property
    def size(self) -> int:
        return len(self.response_json) + len(self.items_json)

    def items(self) -> list[dict]:
        return json.loads(self.items_json)

    def input_items(self) -> list[dict]:
        return self.items()[self.first_input : self.end_input]


@dataclass
class Running:
    """A background response in progress: its owner, its Response as it stands (queued, then
    in_progress), its conversation's items before the answer, and the task that runs it."""

    owner: str | None
    response: dict
    items: list[dict]
    first_input: int
    task: asyncio.Task | None = None

    @property
    def response_json(self) -> bytes:
        return _json(self.response)

    def input_items(self) -> list[dict]:
        return [dict(item) for item in self.items[self.first_input :]]


@dataclass
class Conversation:
    """A conversation of the Conversations API (router/openai/conversations_api.py): items that
    grow as responses that name it end, each kept as its JSON bytes with its id beside it (so a
    page or one item is read without decoding the others); its size is theirs and its
    metadata's. `full`: a response's turn did not fit its bounds and was not added."""

    owner: str | None
    created_at: int
    metadata: dict
    items: list[bytes]
    size: int = 0
    ids: list[str | None] = field(default_factory=list)
    full: bool = False

    def measure(self) -> int:
        return sum(len(item) for item in self.items) + len(_json(self.metadata))

    def add(self, items: list[dict]) -> None:
        self.items += [_json(item) for item in items]
        self.ids += [item.get("id") for item in items]

    def remove(self, index: int) -> None:
        del self.items[index], self.ids[index]

    def item(self, index: int) -> dict:
        return json.loads(self.items[index])

    def dicts(self) -> list[dict]:
        return [json.loads(item) for item in self.items]

    def card(self, conversation_id: str) -> dict:
        return {
            "id": conversation_id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        }


class ResponseStore:
    """Stored responses and conversations by id, least recently used first (the module's
    docstring): one bound for both."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"the responses store's size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, Stored | Conversation] = OrderedDict()
        self.conversations = 0  # how many of the entries are conversations
        # background responses in progress (router/openai/responses_api.py), apart from the LRU:
        # never evicted, at most MAX_RUNNING; each is stored as it ends
        self.running: dict[str, Running] = {}

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        """The stored responses (conversations are counted apart)."""
        return len(self._entries) - self.conversations

    def put(
        self,
        response: dict,
        items: list[dict],
        inputs: tuple[int, int],
        owner: str | None,
    ) -> bool:
        """Keeps `response` (its "id" is the key) with its conversation `items`, whose
        [inputs[0], inputs[1]) are the request's input; False when it is larger than the store."""
        stored = Stored(owner, _json(response), _json(items), *inputs)
        return self._keep(response["id"], stored, stored.size)

    def _keep(self, key: str, entry, size: int) -> bool:
        if size > self.max_bytes:
            return False
        self._drop(key)
        self._make_room(size)
        self._entries[key] = entry
        self.bytes += size
        self.conversations += isinstance(entry, Conversation)
        return True

    def _make_room(self, size: int, keep: str | None = None) -> None:
        """Evicts the least recently used entries (never `keep`) until `size` more bytes fit."""
        while self.bytes + size > self.max_bytes and self._entries:
            key = next(iter(self._entries))
            if key == keep:  # the one being grown: the next least recently used goes instead
                self._entries.move_to_end(key)
                if next(iter(self._entries)) == key:
                    return
                continue
            self._drop(key)

    # ---- conversations
    @property
    def max_conversation_bytes(self) -> int:
        return self.max_bytes // CONVERSATION_SHARE

    def create_conversation(self, key: str, conversation: Conversation) -> bool:
        """Keeps a new conversation; False when it is larger than a conversation may be."""
        conversation.size = conversation.measure()
        if conversation.size > self.max_conversation_bytes:
            return False
        return self._keep(key, conversation, conversation.size)

    def extend(self, key: str, conversation: Conversation, items: list[dict]) -> bool:
        """Adds `items` to the conversation stored as `key`, evicting others to make room; False,
        and the conversation left as it was, when it would pass MAX_CONVERSATION_ITEMS or
        max_conversation_bytes."""
        encoded = [_json(item) for item in items]
        count = len(conversation.items) + len(encoded)
        size = conversation.size + sum(len(item) for item in encoded)
        if count > MAX_CONVERSATION_ITEMS or size > self.max_conversation_bytes:
            return False
        conversation.items += encoded
        conversation.ids += [item.get("id") for item in items]
        return self.resize(key, conversation)

    def conversation(self, key: str, owner: str | None) -> Conversation | None:
        entry = self._entries.get(key)
        if not isinstance(entry, Conversation) or entry.owner != owner:
            return None
        self._entries.move_to_end(key)
        return entry

    def resize(self, key: str, conversation: Conversation) -> bool:
        """Accounts a changed conversation (items added or removed, metadata replaced), evicting
        others to make room; False, and nothing accounted, when it would be larger than a
        conversation may be (max_conversation_bytes): the caller undoes its change. A
        conversation no longer stored under `key` (deleted or evicted while its change was made)
        is not accounted at all: its bytes are in no entry, so counting them would keep them in
        the store's total for good."""
        if self._entries.get(key) is not conversation:
            return True
        size = conversation.measure()
        if size > self.max_conversation_bytes:
            return False
        self.bytes += size - conversation.size
        conversation.size = size
        self._make_room(0, keep=key)
        return True

    def get(self, response_id: str, owner: str | None) -> Stored | Running | None:
        """The response `response_id` when `owner` may read it: a background one in progress,
        or a stored one (now the most recently used)."""
        running = self.running.get(response_id)
        if running is not None:
            return running if running.owner == owner else None
        stored = self._entries.get(response_id)
        if not isinstance(stored, Stored) or stored.owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return stored

    def delete(self, key: str, owner: str | None) -> bool:
        """Whether `owner` deleted the stored response or conversation `key` (not a response in
        progress)."""
        entry = self._entries.get(key)
        if entry is None or entry.owner != owner:
            return False
        self._drop(key)
        return True

    async def stop(self) -> None:
        """Cancels the background responses in progress (each is stored as cancelled) and waits
        for them: the HTTP front's last step before it closes its channel to the router."""
        tasks = [r.task for r in self.running.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.size
            self.conversations -= isinstance(entry, Conversation)
