"""Server-sent events as OpenAI's streaming endpoints frame them: one ``data: <json>``
event per chunk (usage as the stream options ask), an error event after streaming began,
and ``data: [DONE]`` last. Every event encodes as UTF-8 whatever its strings hold
(:func:`~manylora.entrypoints.openai.encoding.json_text`)."""

from __future__ import annotations

from pydantic import BaseModel

from manylora.entrypoints.openai.encoding import json_text
from manylora.entrypoints.openai.errors import OpenAIError
from manylora.entrypoints.openai.protocol import PromptTokensDetails, StreamOptions, UsageInfo

__all__ = ["SSE_DONE", "chunk_event", "sse_error", "sse_event", "usage_info"]

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict) -> str:
    """One server-sent event, ``data: <json>\\n\\n``, of a pydantic model or a dict.

    Raises:
        ValueError: a float in it is NaN or infinite (JSON has neither).
    """
    data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    return f"data: {json_text(data)}\n\n"


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


def usage_info(prompt_tokens: int, completion_tokens: int,
               cached_tokens: int | None = None) -> UsageInfo:
    """A :class:`UsageInfo` with its total, and ``prompt_tokens_details.cached_tokens``
    when ``cached_tokens`` is given."""
    details = None if cached_tokens is None else PromptTokensDetails(
        cached_tokens=cached_tokens)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=details)
