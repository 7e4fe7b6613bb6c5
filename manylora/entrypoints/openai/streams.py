"""The engine requests of one HTTP request: each choice of each prompt is a child request
(vLLM's parallel sampling), and their output streams run concurrently, merged into one
(:class:`MergedStream`); closing it aborts every unfinished child."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from manylora.engine.outputs import RequestOutput
from manylora.sampling_params import SamplingParams

__all__ = ["ChildRequest", "MergedStream", "guard_stream"]


@dataclass
class ChildRequest:
    """One engine request of an HTTP request: one choice of one prompt.

    Attributes:
        request_id: the engine request id (unique).
        prompt_index: which prompt of the request it completes.
        prompt_token_ids: that prompt's ids; ``prompt_text`` its text when known.
        params: its sampling parameters (``n == 1``).
        cache_salt: salts its prefix-cache hashes (vLLM's ``cache_salt``), or None.
    """

    request_id: str
    prompt_index: int
    prompt_token_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    cache_salt: str | None = None

    def engine_prompt(self) -> dict[str, Any]:
        """The prompt as ``AsyncLLM.generate`` takes it (ids, and the text and the cache
        salt when known)."""
        prompt: dict[str, Any] = {"prompt_token_ids": self.prompt_token_ids}
        if self.prompt_text is not None:
            prompt["prompt"] = self.prompt_text
        if self.cache_salt is not None:
            prompt["cache_salt"] = self.cache_salt
        return prompt


_END = object()


@dataclass
class MergedStream:
    """The output streams of several engine requests, run concurrently, as one stream of
    ``(child_index, RequestOutput)`` pairs; each child's outputs keep their order.

    Each child's generator is iterated by its own task that feeds one queue. :meth:`prime`
    waits for every child's first output, so that the engine's rejection of a child
    (``ValueError``, ``EngineOverloadedError``, ...) is raised before anything is streamed.
    Iterating raises the first error a child meets. :meth:`close` (sync) aborts every
    child whose last output was not taken yet and cancels the tasks; :meth:`aclose` also
    waits for them. Create it on the event loop that iterates it.

    Args:
        engine: has ``abort(request_ids)``.
        request_ids: the children's engine request ids.
        generators: the children's ``AsyncLLM.generate`` iterators, in the same order.
    """

    engine: Any
    request_ids: list[str]
    generators: list[AsyncIterator[RequestOutput]]
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue, init=False, repr=False)
    _buffer: deque = field(default_factory=deque, init=False, repr=False)
    _tasks: list[asyncio.Task] = field(default_factory=list, init=False, repr=False)
    _finished: list[bool] = field(default_factory=list, init=False)
    _live: int = field(default=0, init=False)
    _closed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._finished = [False] * len(self.generators)
        self._live = len(self.generators)
        # one child (n = 1, one prompt: the common case) is iterated directly, without a
        # task and a second queue between it and the response
        self._direct = len(self.generators) == 1
        if not self._direct:
            self._tasks = [self._loop.create_task(self._pump(i, gen))
                           for i, gen in enumerate(self.generators)]

    async def _next_direct(self) -> tuple[int, object]:
        try:
            return 0, await self.generators[0].__anext__()
        except StopAsyncIteration:
            return 0, _END
        except Exception as e:
            return 0, e

    async def _pump(self, index: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in gen:
                self._queue.put_nowait((index, output))
            self._queue.put_nowait((index, _END))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._queue.put_nowait((index, e))
        finally:
            aclose = getattr(gen, "aclose", None)
            if aclose is not None:
                await aclose()

    async def prime(self) -> None:
        """Wait until every child gave its first output (kept for iteration).

        Raises:
            Exception: the first error a child met (the caller closes the stream).
        """
        seen: set[int] = set()
        while len(seen) < len(self.generators):
            index, item = await (self._next_direct() if self._direct else self._queue.get())
            self._buffer.append((index, item))
            if isinstance(item, BaseException):
                raise item
            seen.add(index)

    def __aiter__(self) -> MergedStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        """The next ``(child_index, output)``.

        Raises:
            StopAsyncIteration: every child finished.
            Exception: a child's error (``EngineDeadError``, ...).
        """
        while self._live > 0:
            if self._buffer:
                index, item = self._buffer.popleft()
            else:
                index, item = await (self._next_direct() if self._direct else self._queue.get())
            if item is _END:
                self._live -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self._finished[index] = True
            return index, item
        raise StopAsyncIteration

    @property
    def unfinished_ids(self) -> list[str]:
        """The request ids whose last output was not taken yet."""
        return [rid for rid, done in zip(self.request_ids, self._finished) if not done]

    def close(self) -> None:
        """Abort the unfinished children in the engine and cancel the tasks (any thread;
        idempotent; no waiting)."""
        if self._closed:
            return
        self._closed = True
        ids = self.unfinished_ids
        if ids:
            self.engine.abort(ids)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            for task in self._tasks:
                task.cancel()
            return
        try:
            for task in self._tasks:
                self._loop.call_soon_threadsafe(task.cancel)
        except RuntimeError:     # the loop is closed: the tasks are gone with it
            pass

    async def aclose(self) -> None:
        """:meth:`close`, then wait for the tasks (and so the child generators) to end."""
        self.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._direct:
            with contextlib.suppress(RuntimeError):    # already closing elsewhere
                await self.generators[0].aclose()


def guard_stream(stream: AsyncIterator[str], merged: MergedStream) -> AsyncIterator[str]:
    """``stream``, with ``merged`` closed (its children aborted) when ``stream`` is
    garbage-collected without having run, e.g. when the client left before the response
    started (a started stream closes ``merged`` in its own ``finally``)."""
    finalizer = weakref.finalize(stream, merged.close)
    finalizer.atexit = False
    return stream
