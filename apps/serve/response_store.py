"""The conversations behind /v1/responses' `previous_response_id`: bounded, least recently used out first."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

MAX_STORED_RESPONSES = 256


class ResponseStore:
    """response id -> the conversation up to and including that response (chat messages), LRU-bounded."""

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES) -> None:
        self.max_entries = max_entries
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()  # handlers prepare on worker threads

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            found = self._items.get(response_id)
            if found is not None:
                self._items.move_to_end(response_id)
            return found

    def put(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response_id] = conversation
            self._items.move_to_end(response_id)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


__all__ = ["MAX_STORED_RESPONSES", "ResponseStore"]
