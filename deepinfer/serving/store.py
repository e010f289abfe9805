"""Stored responses (the Responses API's `store`), each kept for the tenant that made it.

A finished response is kept with its conversation (what `previous_response_id` continues) and its
input items (what `GET /v1/responses/{id}/input_items` lists), in memory, in an LRU of at most
MAX_STORED_RESPONSES responses and MAX_STORED_CHARS characters of JSON (the least recently used go
first; a restart forgets them all). Every read names the tenant asking: another tenant's response
is exactly as missing as an unknown id (an operator key sees all). Thread-safe: read in the
tokenizer pool, written on the event loop.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from deepinfer.serving.tenancy import Tenant

MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 64 << 20


@dataclass(frozen=True)
class StoredResponse:
    owner: str  # the tenant id
    response: dict
    conversation: list[dict]  # chat messages: the history, this input and the answer
    input_items: list[dict]  # this response's input, as Responses items
    size: int  # characters of JSON


class ResponseStore:
    """Finished responses by id, per tenant: an LRU bounded in count and characters."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS):
        self.max_responses, self.max_chars = max_responses, max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, owner: Tenant, response: dict, conversation: list[dict], input_items: list[dict]) -> None:
        size = sum(len(json.dumps(part)) for part in (response, conversation, input_items))
        entry = StoredResponse(owner.id, response, conversation, input_items, size)
        with self._lock:
            old = self._entries.pop(response["id"], None)
            self._chars += size - (old.size if old is not None else 0)
            self._entries[response["id"]] = entry
            while self._entries and (len(self._entries) > self.max_responses or self._chars > self.max_chars):
                self._chars -= self._entries.popitem(last=False)[1].size

    def get(self, tenant: Tenant, response_id: str) -> StoredResponse | None:
        """The response if `tenant` may see it (None: unknown, forgotten, or another tenant's)."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or not tenant.owns(entry.owner):
                return None
            self._entries.move_to_end(response_id)
            return entry

    def delete(self, tenant: Tenant, response_id: str) -> bool:
        """Forget the response if `tenant` may see it; whether it did."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or not tenant.owns(entry.owner):
                return False
            del self._entries[response_id]
            self._chars -= entry.size
            return True
