"""Per-request output streams of ``AsyncLLM``: the engine's thread hands each request's
``RequestOutput``s (or the error that ended it) to an ``asyncio.Queue`` on its caller's event
loop, with one wake-up of each loop per step (vLLM's ``RequestOutputCollector`` plays this
part in its ``AsyncLLM``).

Everything here runs on the engine's thread except what ``call_soon`` schedules, which runs
on the caller's loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from manylora.engine.outputs import RequestOutput


@dataclass
class OutputStream:
    """One request's output queue on its caller's event loop, and when it arrived
    (``time.monotonic``, seconds)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float


def call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """Schedule ``fn(*args)`` on ``loop`` from any thread; False when the loop has closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


def settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Answer ``future`` (on its loop) with ``error`` or ``result``, unless it is done."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _put_all(batch: list[tuple[OutputStream, RequestOutput | BaseException]]) -> None:
    for stream, out in batch:
        stream.queue.put_nowait(out)


class OutputStreams:
    """The live requests' streams, by request id (the engine's thread only)."""

    def __init__(self) -> None:
        self._streams: dict[str, OutputStream] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def add(self, request_id: str, stream: OutputStream) -> None:
        self._streams[request_id] = stream

    def discard(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def live(self, request_ids: Iterable[str], only: OutputStream | None = None) -> list[str]:
        """The ids among ``request_ids`` that have a stream (``only``: that very stream,
        so an abort from a ``generate`` that ended never ends a later request of the same
        id)."""
        streams = self._streams
        return [rid for rid in request_ids if rid in streams
                and (only is None or streams[rid] is only)]

    def dispatch(self, outputs: Iterable[RequestOutput]) -> list[str]:
        """Hand a step's outputs to their streams (a finished request's stream goes; an
        output with ``error`` set delivers the error itself), one wake-up per event loop.

        Returns:
            The unfinished requests whose caller's event loop has closed (to abort).
        """
        batches: dict[asyncio.AbstractEventLoop,
                      list[tuple[OutputStream, RequestOutput | BaseException]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(stream.loop, []).append(
                (stream, out if out.error is None else out.error))
        return [out.request_id for loop, batch in batches.items()
                if not call_soon(loop, _put_all, batch)
                for _, out in batch if isinstance(out, RequestOutput) and not out.finished]

    def fail_all(self, error: BaseException) -> None:
        """End every stream with ``error`` and forget them."""
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            call_soon(stream.loop, stream.queue.put_nowait, error)
