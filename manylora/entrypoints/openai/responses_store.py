"""``ResponseStore``: the responses ``/v1/responses`` keeps (``store``, OpenAI's default) in
memory, by id, each with the conversation it ended, for ``GET /v1/responses/{id}`` and
``previous_response_id``; bounded by count and by characters, least recently used dropped
first (vLLM keeps them in memory too)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from manylora.entrypoints.openai.protocol_responses import ResponsesResponse

__all__ = ["DEFAULT_MAX_STORED_CHARS", "DEFAULT_MAX_STORED_RESPONSES", "ResponseStore"]

#: The most responses :class:`ResponseStore` keeps by default.
DEFAULT_MAX_STORED_RESPONSES = 1024
#: The most characters of conversation text it keeps in all, by default (64 Mi).
DEFAULT_MAX_STORED_CHARS = 64 * 2**20


@dataclass
class _Stored:
    response: ResponsesResponse
    conversation: list[dict[str, Any]]
    chars: int


def _chars(message: dict[str, Any]) -> int:
    """The characters of one conversation message's text and tool calls."""
    calls = message.get("tool_calls")
    return len(message.get("content") or "") + (len(json.dumps(calls)) if calls else 0)


class ResponseStore:
    """Stored responses in memory, by id: each response and the conversation it ended
    (its input messages, without ``instructions``, then its reply), for ``GET`` and for
    ``previous_response_id``. Bounded by count and by the conversation text's characters;
    the least recently used entries go first. Thread-safe.

    Args:
        max_responses: the most responses kept (at least 1).
        max_chars: the most characters of conversation text kept in all.

    Raises:
        ValueError: a bound below 1.
    """

    def __init__(self, max_responses: int = DEFAULT_MAX_STORED_RESPONSES,
                 max_chars: int = DEFAULT_MAX_STORED_CHARS) -> None:
        if max_responses < 1 or max_chars < 1:
            raise ValueError(f"the store's bounds must be at least 1, got {max_responses} "
                             f"responses and {max_chars} characters")
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._entries: OrderedDict[str, _Stored] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponsesResponse, conversation: list[dict[str, Any]]) -> None:
        """Keep ``response`` and its ``conversation`` (dropping the least recently used
        entries over the bounds; a conversation larger than ``max_chars`` is not kept)."""
        chars = sum(_chars(m) for m in conversation)
        if chars > self.max_chars:
            return
        with self._lock:
            old = self._entries.pop(response.id, None)
            if old is not None:
                self._chars -= old.chars
            self._entries[response.id] = _Stored(response, conversation, chars)
            self._chars += chars
            while len(self._entries) > self.max_responses or self._chars > self.max_chars:
                _, dropped = self._entries.popitem(last=False)
                self._chars -= dropped.chars

    def get(self, response_id: str) -> tuple[ResponsesResponse, list[dict[str, Any]]] | None:
        """The stored response and conversation, or None."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            self._entries.move_to_end(response_id)
            return entry.response, entry.conversation
