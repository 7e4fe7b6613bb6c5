"""What the completions and chat endpoints share.

* :class:`OpenAIServing`: the base of both, holding the engine and the models registry:
  model lookup, tokenization, the context-length checks, and starting the engine requests
  of one HTTP request (``n`` choices per prompt, each its own engine request, as vLLM's
  parallel sampling: child ``i`` gets ``n=1`` and ``seed + i``).
* :class:`MergedStream`: the child requests' output streams run concurrently and merged
  into one, each child's outputs in order; closing it aborts every unfinished child.
* The engine requests of a streamed HTTP request report ``DELTA`` outputs (only what is
  new, with no part of a stop string ever in them), the others ``FINAL_ONLY`` (one output
  at the end): :func:`output_kind`.
* Server-sent event framing (:func:`sse_event`, :data:`SSE_DONE`, :func:`sse_error`),
  usage counts, and the mapping of engine errors to HTTP errors (:func:`to_openai_error`).

Every check of a request runs before its stream is handed back, so a bad request gets its
own status code; an error after streaming began is sent as one ``data: {"error": ...}``
event before ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from manylora.engine.async_llm import EngineDeadError, EngineOverloadedError
from manylora.engine.outputs import RequestOutput
from manylora.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    not_found,
    overloaded,
    too_large,
)
from manylora.entrypoints.openai.protocol import StreamOptions, UsageInfo
from manylora.lora.request import LoRARequest
from manylora.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "LOGPROB_FLOOR",
    "SSE_DONE",
    "ChildRequest",
    "MergedStream",
    "OpenAIServing",
    "check_context_length",
    "guard_stream",
    "child_sampling_params",
    "chunk_event",
    "clamp_logprob",
    "make_sampling_params",
    "random_id",
    "sse_error",
    "sse_event",
    "output_kind",
    "to_openai_error",
    "token_text",
    "usage_info",
]

SSE_DONE = "data: [DONE]\n\n"

# JSON has no -inf: log-probabilities below this are sent as this (as vLLM).
LOGPROB_FLOOR = -9999.0

_SAMPLING_FIELDS = frozenset({
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
    "stop_token_ids", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
    "logprobs"})


def random_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-<32 hex digits>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def sse_event(payload: BaseModel | dict) -> str:
    """One server-sent event, ``data: <json>\\n\\n``, of a pydantic model or a dict."""
    data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_error(error: OpenAIError) -> str:
    """The event that reports an error after streaming began: ``data: {"error": ...}``."""
    return sse_event(error.body())


def chunk_event(chunk: BaseModel, stream_options: StreamOptions | None,
                usage: UsageInfo | None) -> str:
    """A streamed chunk (completion or chat) as an event, with ``usage`` as the stream
    options want it: absent without ``include_usage``, the usage so far with
    ``continuous_usage_stats`` (vLLM), ``null`` otherwise."""
    data = chunk.model_dump(mode="json")
    if stream_options is None or not stream_options.include_usage:
        data.pop("usage", None)
    elif stream_options.continuous_usage_stats and usage is not None:
        data["usage"] = usage.model_dump(mode="json")
    else:
        data["usage"] = None
    return sse_event(data)


def clamp_logprob(value: float) -> float:
    """A log-probability JSON can carry: ``-inf`` (and anything below) becomes
    :data:`LOGPROB_FLOOR`, NaN too."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def token_text(token_id: int, decoded: str | None, as_token_id: bool = False) -> str:
    """A token's text for log-probabilities: its decoded text, or ``token_id:<id>`` (vLLM's
    form) when asked for (``return_tokens_as_token_ids``) or without a tokenizer."""
    return f"token_id:{token_id}" if as_token_id or decoded is None else decoded


def usage_info(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """A :class:`UsageInfo` with its total."""
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def to_openai_error(exc: BaseException) -> OpenAIError | None:
    """The HTTP error for an exception from a request's checks or from the engine: itself
    for an ``OpenAIError``, 400 for ``ValueError`` (bad prompt, parameters or adapter), 404
    for a missing adapter file, 503 for ``EngineOverloadedError`` and ``EngineDeadError``;
    None for anything else (a server bug, left to propagate)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return overloaded(f"the server is overloaded: {exc}")
    if isinstance(exc, EngineDeadError):
        return overloaded(f"the engine is not serving: {exc}")
    if isinstance(exc, FileNotFoundError):
        return not_found(f"adapter files not found: {exc}", param="model")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    return None


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                         *, prompt_param: str = "prompt",
                         max_tokens_param: str = "max_tokens") -> int:
    """The number of tokens a choice may generate, after checking it fits the context.

    Args:
        num_prompt_tokens: the prompt's length in tokens.
        max_tokens: what the request asked for; None: up to the end of the context.
        max_model_len: the context length.
        prompt_param, max_tokens_param: the parameter names errors report.

    Raises:
        OpenAIError: 400 (``max_tokens_param``) for ``max_tokens < 1``; 413
            (``context_length_exceeded``) for a prompt of ``max_model_len`` tokens or more;
            400 (``max_tokens_param``) when prompt + ``max_tokens`` exceeds the context.
    """
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{max_tokens_param} must be at least 1, got {max_tokens}",
                          param=max_tokens_param)
    if num_prompt_tokens >= max_model_len:
        raise too_large(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {num_prompt_tokens} tokens, leaving no room to generate. Please reduce the "
            "length of the prompt.", param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} in the completion). Please reduce the length of the "
            f"prompt or {max_tokens_param}.", param=max_tokens_param)
    return max_tokens


def make_sampling_params(**fields: Any) -> SamplingParams:
    """``SamplingParams(**fields)``, its ValueError turned into a 400.

    Raises:
        OpenAIError: 400 with SamplingParams' message, ``param`` the field it names.
    """
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        message = str(e)
        first = message.split(" ", 1)[0]
        raise bad_request(message, param=first if first in _SAMPLING_FIELDS else None) from None


def output_kind(stream: bool) -> RequestOutputKind:
    """What the engine reports for a request: ``DELTA`` when streamed (each chunk is the
    new part), else ``FINAL_ONLY`` (the response is built from the last output)."""
    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


def child_sampling_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The ``n`` children's parameters for one prompt: the same, but child ``i`` seeded
    with ``seed + i`` when a seed is set (vLLM's parallel sampling)."""
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]


@dataclass
class ChildRequest:
    """One engine request of an HTTP request: one choice of one prompt.

    Attributes:
        request_id: the engine request id (unique).
        prompt_index: which prompt of the request it completes.
        prompt_token_ids: that prompt's ids; ``prompt_text`` its text when known.
        params: its sampling parameters (``n == 1``).
    """

    request_id: str
    prompt_index: int
    prompt_token_ids: list[int]
    prompt_text: str | None
    params: SamplingParams

    def engine_prompt(self) -> dict[str, Any]:
        """The prompt as ``AsyncLLM.generate`` takes it (ids, and the text when known)."""
        prompt: dict[str, Any] = {"prompt_token_ids": self.prompt_token_ids}
        if self.prompt_text is not None:
            prompt["prompt"] = self.prompt_text
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


class OpenAIServing:
    """Base of the endpoint classes: the engine, the models registry and the checks and
    start-up every request goes through.

    Args:
        engine: an ``AsyncLLM`` (``tokenizer``, ``max_model_len``, ``generate``, ``abort``).
        models: has ``base_model_name`` and ``resolve(name) -> LoRARequest | None``
            (raising a 404 ``OpenAIError`` for an unknown name).
    """

    def __init__(self, engine: Any, models: Any) -> None:
        self.engine = engine
        self.models = models

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer, or None."""
        return getattr(self.engine, "tokenizer", None)

    @property
    def max_model_len(self) -> int:
        """The context length in tokens."""
        return int(self.engine.max_model_len)

    def resolve_model(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """The name to report and the adapter for a request's ``model`` (None or the base
        model's name: no adapter).

        Raises:
            OpenAIError: 404 for an unknown model.
        """
        if name is None or name == "":
            return self.models.base_model_name, None
        return name, self.models.resolve(name)

    def require_tokenizer(self, what: str, param: str | None = None) -> Any:
        """The tokenizer, for ``what`` needs one.

        Raises:
            OpenAIError: 400 when the engine was started without a tokenizer.
        """
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise bad_request(f"{what} needs a tokenizer, but the server was started "
                              "without one (skip_tokenizer_init)", param=param)
        return tokenizer

    def tokenize(self, text: str, add_special_tokens: bool = True,
                 param: str = "prompt") -> list[int]:
        """The token ids of ``text``.

        Raises:
            OpenAIError: 400 without a tokenizer, or when the tokenizer fails on the text.
        """
        tokenizer = self.require_tokenizer("a text prompt", param=param)
        try:
            return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        except Exception as e:
            raise bad_request(f"the {param} could not be tokenized: {e}", param=param) from e

    async def start(self, children: list[ChildRequest],
                    lora_request: LoRARequest | None) -> MergedStream:
        """Send the children to the engine and wait for each one's first output, so that
        the engine's rejection surfaces here.

        Raises:
            OpenAIError: 400 (``ValueError`` from the engine), 404 (missing adapter files),
                503 (overloaded or stopped engine); every child already added is aborted.
        """
        gens = [self.engine.generate(c.engine_prompt(), c.params, request_id=c.request_id,
                                     lora_request=lora_request) for c in children]
        merged = MergedStream(self.engine, [c.request_id for c in children], gens)
        try:
            await merged.prime()
        except BaseException as e:
            merged.close()
            error = to_openai_error(e) if isinstance(e, Exception) else None
            if error is None:
                raise
            raise error from e
        return merged

    async def collect(self, merged: MergedStream) -> list[RequestOutput]:
        """Every child's last output, in child order (for a non-streamed response).

        Raises:
            OpenAIError: an engine error met on the way (503 for a stopped engine).
        """
        finals: list[RequestOutput | None] = [None] * len(merged.request_ids)
        try:
            async for index, output in merged:
                finals[index] = output
        except Exception as e:
            error = to_openai_error(e)
            if error is None:
                raise
            raise error from e
        finally:
            merged.close()
        return [f for f in finals if f is not None]

    @staticmethod
    def stream_error(exc: Exception) -> str:
        """The error event for an exception met after streaming began (logged when it is
        not an expected engine error)."""
        error = to_openai_error(exc)
        if error is None:
            logger.exception("a streamed request failed", exc_info=exc)
            error = OpenAIError(500, f"internal server error: {exc!r}")
        return sse_error(error)

    @staticmethod
    async def finish_stream(merged: MergedStream) -> None:
        """Clean up after a stream, even while being cancelled: ``aclose`` aborts and
        cancels before it first waits, then waits for the tasks if the task still may."""
        try:
            await merged.aclose()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("closing a request's engine streams failed")

    @staticmethod
    def now() -> int:
        """The ``created`` timestamp: seconds since the epoch."""
        return int(time.time())
