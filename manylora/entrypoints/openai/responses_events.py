"""The server-sent events of a streamed ``/v1/responses`` answer, as OpenAI frames them
(``event: <type>`` / ``data: <json>``, each with its ``sequence_number``): a message item's
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; a function call item's
``response.output_item.added``, ``response.function_call_arguments.delta`` ...,
``response.function_call_arguments.done``, ``response.output_item.done``."""

from __future__ import annotations

import uuid
from typing import Any

from manylora.entrypoints.openai.encoding import json_text
from manylora.entrypoints.openai.protocol_responses import (
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)
from manylora.entrypoints.openai.serving_tools import ToolPlan

__all__ = ["StreamedItems", "output_message", "response_event"]


def response_event(event: Any) -> str:
    """One server-sent event as OpenAI's Responses API frames it: ``event: <type>`` and
    ``data: <json>``."""
    return f"event: {event.type}\ndata: {json_text(event.model_dump(mode='json'))}\n\n"


def output_message(item_id: str, text: str, finish_reason: str | None,
                   logprobs: list | None) -> ResponseOutputMessage:
    """A finished message item: ``incomplete`` when the length cut it, else
    ``completed``; its text and the tokens' log-probabilities (None: not asked for)."""
    status = "incomplete" if finish_reason == "length" else "completed"
    return ResponseOutputMessage(id=item_id, status=status, content=[
        ResponseOutputText(text=text, logprobs=logprobs)])


class StreamedItems:
    """The output items of one streamed response as events: the text of a message item
    (its content part's deltas) and, through the plan's
    :class:`~manylora.entrypoints.openai.serving_tools.ToolStream`, a ``function_call`` item
    per call (its arguments' deltas). One item is open at a time: text after a call opens
    a new message item, a new call closes what is open.

    Args:
        plan: the request's tool plan (mode ``none``: text only).
        max_calls: ``max_tool_calls``: the calls past it are left out; None: no bound.
    """

    def __init__(self, plan: ToolPlan, max_calls: int | None = None) -> None:
        self.seq = iter(range(2**62))
        self.tools = plan.stream()
        self.max_calls = max_calls
        self.done: list[Any] = []        # the finished items, in output order
        self._opened = 0                 # items opened so far (the next output_index)
        self._message: tuple[str, int, list[str], list] | None = None
        self._call: tuple[ResponseFunctionToolCall, int, int, list[str]] | None = None

    def _event(self, cls: type, **fields: Any) -> str:
        return response_event(cls(sequence_number=next(self.seq), **fields))

    def open_message(self) -> list[str]:
        """Open a message item and its ``output_text`` part."""
        item_id, index = f"msg_{uuid.uuid4().hex}", self._opened
        self._opened += 1
        self._message = (item_id, index, [], [])
        empty = ResponseOutputMessage(id=item_id, status="in_progress", content=[])
        return [self._event(ResponseOutputItemAddedEvent, output_index=index, item=empty),
                self._event(ResponseContentPartAddedEvent, part=ResponseOutputText(text=""),
                            item_id=item_id, output_index=index, content_index=0)]

    def _text(self, text: str, logprobs: list) -> list[str]:
        events = self._close_call("completed") if self._message is None else []
        if self._message is None:
            events += self.open_message()
        item_id, index, texts, all_logprobs = self._message
        texts.append(text)
        all_logprobs += logprobs
        return events + [self._event(ResponseTextDeltaEvent, delta=text, logprobs=logprobs,
                                     item_id=item_id, output_index=index, content_index=0)]

    def _piece(self, piece: Any) -> list[str]:
        events = []
        fn = piece.function
        if piece.id is not None:                       # a call's first piece
            events += self._close_message(None, None)
            events += self._close_call("completed")
            item = ResponseFunctionToolCall(id=f"fc_{uuid.uuid4().hex}", call_id=piece.id,
                                            name=fn.name, arguments="", status="in_progress")
            self._call = (item, self._opened, piece.index, [])
            self._opened += 1
            events.append(self._event(ResponseOutputItemAddedEvent,
                                      output_index=self._call[1], item=item))
        if self._call is not None and fn is not None and fn.arguments:
            item, index, _, fragments = self._call
            fragments.append(fn.arguments)
            events.append(self._event(ResponseFunctionCallArgumentsDeltaEvent,
                                      item_id=item.id, output_index=index,
                                      delta=fn.arguments))
        return events

    def feed(self, text: str, logprobs: list, finished: bool) -> list[str]:
        """The events of the output's new ``text`` (and its tokens' log-probabilities);
        ``finished``: the last output (the tool parser's held-back text comes out)."""
        if self.tools is None:
            return self._text(text, logprobs) if text or logprobs else []
        delta = self.tools.delta(text, finished)
        events = self._text(delta.content, []) if delta.content else []
        for piece in delta.tool_calls or ():
            if self.max_calls is None or piece.index < self.max_calls:
                events += self._piece(piece)
        return events

    def _close_message(self, finish_reason: str | None, wants_logprobs: bool | None) -> list[str]:
        if self._message is None:
            return []
        item_id, index, texts, logprobs = self._message
        self._message = None
        text = "".join(texts)
        message = output_message(item_id, text, finish_reason,
                                 logprobs if wants_logprobs else None)
        self.done.append(message)
        where = dict(item_id=item_id, output_index=index, content_index=0)
        return [self._event(ResponseTextDoneEvent, text=text, logprobs=logprobs, **where),
                self._event(ResponseContentPartDoneEvent, part=message.content[0], **where),
                self._event(ResponseOutputItemDoneEvent, output_index=index, item=message)]

    def _close_call(self, status: str) -> list[str]:
        if self._call is None:
            return []
        item, index, _, fragments = self._call
        self._call = None
        item = item.model_copy(update=dict(arguments="".join(fragments), status=status))
        self.done.append(item)
        return [self._event(ResponseFunctionCallArgumentsDoneEvent, item_id=item.id,
                            output_index=index, name=item.name, arguments=item.arguments),
                self._event(ResponseOutputItemDoneEvent, output_index=index, item=item)]

    def finish(self, finish_reason: str | None, wants_logprobs: bool) -> list[str]:
        """Close the open item (opening an empty message when nothing was output)."""
        events = [] if self._opened else self.open_message()
        events += self._close_message(finish_reason, wants_logprobs)
        events += self._close_call("incomplete" if finish_reason == "length"
                                   else "completed")
        return events
