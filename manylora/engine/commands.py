"""Calls into ``AsyncLLM``'s engine thread: callers on any thread queue a ``Command`` (add,
abort, read or remove an adapter, stop); the engine's thread runs them between steps and
answers each caller's ``asyncio.Future`` on the caller's event loop."""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass, field
from typing import Any

from manylora.engine.output_streams import call_soon, settle


@dataclass
class Command:
    """One call for the engine's thread: it runs ``AsyncLLM._do_<name>(*args)``.

    Attributes:
        name: the call.
        args: its arguments.
        loop: the caller's event loop (None: nobody waits for the answer).
        future: the caller's future on ``loop``, answered with the result or the error.
    """

    name: str
    args: tuple
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future | None = field(default=None, repr=False)

    def answer(self, result: Any, error: BaseException | None = None) -> None:
        """Settle the caller's future on its loop (any thread; nothing without one)."""
        if self.future is not None:
            call_soon(self.loop, settle, self.future, result, error)


@dataclass(frozen=True)
class Deferred:
    """What a command returns when its caller is answered later: an add is answered when
    the core's answer to ``request_id`` comes."""

    request_id: str


class CommandQueue:
    """Commands from any thread, taken by the engine's thread in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()

    def put(self, command: Command) -> None:
        self._queue.put(command)

    def get(self, timeout: float | None = None) -> Command | None:
        """The next command, waiting up to ``timeout`` seconds (None: not at all); None
        when there is none."""
        try:
            if timeout is None:
                return self._queue.get_nowait()
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def fail_all(self, error: BaseException) -> None:
        """Answer every queued command with ``error`` (any thread, once the loop ended)."""
        while (command := self.get()) is not None:
            command.answer(None, error)
