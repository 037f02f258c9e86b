"""The HTTP front's stored Responses (OpenAI's Responses API with `store`): what a later request
needs to continue a conversation by `previous_response_id`, and what GET /v1/responses/{id},
its /input_items and DELETE read (router/openai/responses_api.py serves them).

A stored response is its Response object as answered, and the conversation's items up to and
including its output (earlier responses' items first, then this request's input items, then its
output items), kept as compact JSON bytes so that the store's bound is the memory it takes. Each
response holds its whole conversation, so a chain's later responses are its larger ones, and any
of them can be continued or deleted alone. The store keeps at most `max_bytes`: a new response
evicts the least recently used ones (stored or read) until it fits, and one larger than the whole
store is not kept. It lives in the router process's memory only: a restart forgets everything.

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
from dataclasses import dataclass

# background responses in progress at once, at most (each holds one call of the router's)
MAX_RUNNING = 1024


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


class ResponseStore:
    """Stored responses by id, least recently used first (the module's docstring)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"the responses store's size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        # background responses in progress (router/openai/responses_api.py), apart from the LRU:
        # never evicted, at most MAX_RUNNING; each is stored as it ends
        self.running: dict[str, Running] = {}

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

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
        if stored.size > self.max_bytes:
            return False
        self._drop(response["id"])
        while self._entries and self.bytes + stored.size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[response["id"]] = stored
        self.bytes += stored.size
        return True

    def get(self, response_id: str, owner: str | None) -> Stored | Running | None:
        """The response `response_id` when `owner` may read it: a background one in progress,
        or a stored one (now the most recently used)."""
        running = self.running.get(response_id)
        if running is not None:
            return running if running.owner == owner else None
        stored = self._entries.get(response_id)
        if stored is None or stored.owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str, owner: str | None) -> bool:
        """Whether `owner` deleted the stored response `response_id` (not one in progress)."""
        if not isinstance(self.get(response_id, owner), Stored):
            return False
        self._drop(response_id)
        return True

    async def stop(self) -> None:
        """Cancels the background responses in progress (each is stored as cancelled) and waits
        for them: the HTTP front's last step before it closes its channel to the router."""
        tasks = [r.task for r in self.running.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _drop(self, response_id: str) -> None:
        stored = self._entries.pop(response_id, None)
        if stored is not None:
            self.bytes -= stored.size
