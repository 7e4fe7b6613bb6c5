"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API for text and
function tools over ``AsyncLLM`` (vLLM's ``serving_responses`` without hosted tools and
reasoning).

The input (``instructions`` as a leading system message, the stored conversation of
``previous_response_id``, then ``input``) is rendered through the chat template and
tokenized on the tokenization worker thread exactly as ``/v1/chat/completions`` renders
messages (the chat endpoint's :meth:`~OpenAIServingChat.render_and_encode`), so the same
greedy request gives the same text on both routes; ``function_call`` and
``function_call_output`` items become an assistant message's ``tool_calls`` and ``tool``
messages. Function ``tools`` (flat, converted to the chat route's shape) and ``tool_choice``
go through the chat route's :class:`~manylora.entrypoints.openai.serving_tools.ToolPlan`:
the same ``--tool-call-parser`` for ``auto``, the same grammar for ``required`` and a named
function; each call is a ``function_call`` output item. One engine request per response, its
own fairness group. Streamed, the events are OpenAI's (``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, ``response.completed``), each
with its ``sequence_number``, framed ``event: <type>`` / ``data: <json>``; a function call
item streams ``response.output_item.added``, ``response.function_call_arguments.delta`` ...,
``response.function_call_arguments.done``, ``response.output_item.done`` in place of a
message's content events. An engine error after the first event ends the stream with
``error`` and ``response.failed``.

With ``store`` (OpenAI's default) the finished response and its conversation are kept in
memory (:class:`ResponseStore`, bounded, least recently used dropped first, as vLLM keeps
them in memory), for ``GET /v1/responses/{id}`` and ``previous_response_id``.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from manylora.engine.outputs import RequestOutput
from manylora.entrypoints.openai.encoding import json_text
from manylora.entrypoints.openai.errors import OpenAIError, bad_request, not_found
from manylora.entrypoints.openai.protocol import (
    ChatCompletionMessageParam,
    ChatCompletionRequest,
)
from manylora.entrypoints.openai.protocol_responses import (
    IncompleteDetails,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseError,
    ResponseErrorEvent,
    ResponseFailedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
    TextFormatJSONObject,
    TextFormatJSONSchema,
)
from manylora.entrypoints.openai.serving import (
    OpenAIServing,
    check_context_length,
    make_sampling_params,
    output_kind,
    to_openai_error,
)
from manylora.entrypoints.openai.serving_chat import OpenAIServingChat, chat_logprobs
from manylora.entrypoints.openai.serving_tools import ToolPlan
from manylora.entrypoints.openai.streams import ChildRequest, MergedStream, guard_stream
from manylora.sampling_params import SamplingParams
from manylora.structured.grammar import check_spec_size
from manylora.structured_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_STORED_CHARS",
    "DEFAULT_MAX_STORED_RESPONSES",
    "OpenAIServingResponses",
    "ResponseStore",
    "response_event",
]

#: The most responses :class:`ResponseStore` keeps by default.
DEFAULT_MAX_STORED_RESPONSES = 1024
#: The most characters of conversation text it keeps in all, by default (64 Mi).
DEFAULT_MAX_STORED_CHARS = 64 * 2**20


def response_event(event: Any) -> str:
    """One server-sent event as OpenAI's Responses API frames it: ``event: <type>`` and
    ``data: <json>``."""
    return f"event: {event.type}\ndata: {json_text(event.model_dump(mode='json'))}\n\n"


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


def _messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input or output items as chat messages: a message as its role and text; a run of
    ``function_call`` items as the ``tool_calls`` of one assistant message (joining the
    assistant message right before them); a ``function_call_output`` as a ``tool``
    message answering its ``call_id`` (the chat route's shapes, as vLLM converts them)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.text()})
        elif hasattr(item, "text"):
            messages.append({"role": item.role, "content": item.text()})
        else:                                                  # an output message
            messages.append({"role": item.role,
                             "content": "".join(part.text for part in item.content)})
    return messages


def _input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    return _messages(request.input)


def _structured(request: ResponsesRequest, max_bytes: int) -> StructuredOutputsParams | None:
    """The output constraint of ``text.format`` (vLLM's mapping: a JSON schema without
    optional whitespace or properties it does not name; ``json_object``: any object).

    Raises:
        OpenAIError: 400 (``text``) for a schema the constraint refuses or one over
            ``max_bytes`` (``--max-structured-output-spec-bytes``).
    """
    fmt = request.text.format if request.text is not None else None
    try:
        if isinstance(fmt, TextFormatJSONSchema):
            params = StructuredOutputsParams(json=fmt.schema_, disable_any_whitespace=True,
                                             disable_additional_properties=True)
            check_spec_size(params, max_bytes)
            return params
        if isinstance(fmt, TextFormatJSONObject):
            return StructuredOutputsParams(json_object=True)
    except ValueError as e:
        raise bad_request(f"text.format: {e}", param="text") from None
    return None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """``logit_bias`` with integer token ids.

    Raises:
        OpenAIError: 400 (``logit_bias``) for a key that is not a token id.
    """
    if not bias:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers as strings)",
                          param="logit_bias") from None


class _StreamedItems:
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
        message = OpenAIServingResponses._message(item_id, text, finish_reason,
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


class OpenAIServingResponses(OpenAIServing):
    """The Responses endpoint.

    Args:
        engine: an ``AsyncLLM``.
        models: the models registry (``base_model_name``, ``resolve(name)``).
        chat: the chat endpoint, whose template and rendering the input goes through.
        store: where stored responses are kept; None: a :class:`ResponseStore` with the
            default bounds.
        kwargs: ``max_choices`` and ``prompt_tokenizer`` of :class:`OpenAIServing`.
    """

    def __init__(self, engine: Any, models: Any, chat: OpenAIServingChat,
                 store: ResponseStore | None = None, **kwargs: Any) -> None:
        super().__init__(engine, models, **kwargs)
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    def retrieve(self, response_id: str) -> ResponsesResponse:
        """A stored response (``GET /v1/responses/{id}``).

        Raises:
            OpenAIError: 404 (``response_id``) for an id not stored (never, or dropped).
        """
        found = self.store.get(response_id)
        if found is None:
            raise not_found(f"no stored response with id {response_id!r}",
                            param="response_id")
        return found[0]

    def _conversation(self, request: ResponsesRequest) -> list[dict[str, Any]]:
        """The previous response's conversation (if any) and this input.

        Raises:
            OpenAIError: 404 (``previous_response_id``) for an id not stored.
        """
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            found = self.store.get(request.previous_response_id)
            if found is None:
                raise not_found(f"no stored response with id "
                                f"{request.previous_response_id!r}",
                                param="previous_response_id")
            history = list(found[1])
        return history + _input_messages(request)

    @staticmethod
    def _chat_request(request: ResponsesRequest,
                      conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request the input renders as: ``instructions`` as a leading system
        message, the conversation, and the tools in the chat route's shape."""
        messages = [{"role": "system", "content": request.instructions}] \
            if request.instructions is not None else []
        return ChatCompletionRequest(
            messages=[ChatCompletionMessageParam(**m) for m in messages + conversation],
            chat_template_kwargs=request.chat_template_kwargs,
            tools=request.chat_tools(), tool_choice=request.chat_tool_choice(),
            parallel_tool_calls=request.parallel_tool_calls)

    def _render_and_encode(self, chat_request: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The prompt text and ids, through the chat endpoint (blocking: run it on the
        tokenization worker); its errors name ``input``."""
        try:
            return self.chat.render_and_encode(chat_request)
        except OpenAIError as e:
            if e.param == "messages":
                e.param = "input"
                e.message = e.message.replace("messages", "input")
            raise

    def _sampling_params(self, request: ResponsesRequest, max_tokens: int) -> SamplingParams:
        return make_sampling_params(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0, seed=request.seed, max_tokens=max_tokens,
            stop=request.stop, ignore_eos=bool(request.ignore_eos),
            skip_special_tokens=(True if request.skip_special_tokens is None
                                 else request.skip_special_tokens),
            include_stop_str_in_output=bool(request.include_stop_str_in_output),
            repetition_penalty=(1.0 if request.repetition_penalty is None
                                else request.repetition_penalty),
            logit_bias=_logit_bias(request.logit_bias),
            logprobs=(request.top_logprobs or 0) if request.wants_logprobs() else None,
            structured_outputs=_structured(request, self.max_spec_bytes),
            output_kind=output_kind(bool(request.stream)))

    def _fit(self, request: ResponsesRequest, token_ids: list[int]) -> tuple[list[int], int]:
        """The prompt ids (with ``truncation: auto``, its oldest tokens dropped until the
        output fits the context, as vLLM truncates) and the most tokens to generate.

        Raises:
            OpenAIError: from :func:`check_context_length` (``input``,
                ``max_output_tokens``).
        """
        if request.truncation == "auto":
            room = self.max_model_len - (request.max_output_tokens or 1)
            if room >= 1 and len(token_ids) > room:
                token_ids = token_ids[-room:]
        max_tokens = check_context_length(len(token_ids), request.max_output_tokens,
                                          self.max_model_len, prompt_param="input",
                                          max_tokens_param="max_output_tokens")
        return token_ids, max_tokens

    async def create_response(
            self, request: ResponsesRequest) -> ResponsesResponse | AsyncIterator[str]:
        """Run a Responses request.

        Returns:
            The response, or for ``stream`` an async iterator of server-sent events (see
            the module docstring). Closing the iterator (or cancelling its task) aborts the
            engine request.

        Raises:
            OpenAIError: before anything is streamed: 400 for an unsupported or invalid
                field (named), a failing chat template, ``max_output_tokens`` past the
                context, a ``text.format`` the engine refuses, or the engine's
                ``ValueError``; 404 for an unknown model or ``previous_response_id``; 413
                (``context_length_exceeded``) for an input filling the context; 503 when
                the engine is overloaded or stopped; 504 for an adapter read too slow.
        """
        request.check()
        if request.tools and len(request.tools) > self.chat.max_tools:
            raise bad_request(f"tools holds {len(request.tools)} functions; the server "
                              f"allows at most {self.chat.max_tools} (--max-tools)",
                              param="tools")
        self.check_choices(1, 1)
        model_name, lora_request = self.resolve_model(request.model)
        conversation = self._conversation(request)
        chat_request = self._chat_request(request, conversation)
        plan = ToolPlan.for_request(chat_request, self.chat.tool_call_parser,
                                    self.chat.enable_auto_tool_choice)
        self.require_tokenizer("/v1/responses", param="input")
        await self.check_structured(plan.structured, "tools")
        text, token_ids = await self.prompts.run(self._render_and_encode, chat_request)
        if not token_ids:
            raise bad_request("the input rendered to an empty prompt", param="input")
        token_ids, max_tokens = self._fit(request, token_ids)
        params = plan.apply(self._sampling_params(request, max_tokens))
        response_id = request.request_id or f"resp_{uuid.uuid4().hex}"
        child = ChildRequest(response_id, 0, token_ids, text, params)
        try:
            merged = await self.start([child], lora_request, client_group=response_id)
        except OpenAIError as e:
            if params.structured_outputs is not None and e.status == 400 and e.param is None:
                e.param = "text"
                e.message = f"text.format: {e.message}"
            raise
        base = self._skeleton(request, response_id, model_name)
        if request.stream:
            return guard_stream(self._stream(request, base, conversation, len(token_ids),
                                             merged, plan), merged)
        final = (await self.collect(merged))[-1]
        response = self._finished(request, base, final, len(token_ids), plan)
        self._keep(request, response, conversation)
        return response

    def _skeleton(self, request: ResponsesRequest, response_id: str,
                  model_name: str) -> ResponsesResponse:
        """The response before any output: ``in_progress``, the request's settings
        echoed."""
        text = (request.text.model_dump(mode="json", by_alias=True, exclude_none=True)
                if request.text is not None and request.text.format is not None
                else {"format": {"type": "text"}})
        return ResponsesResponse(
            id=response_id, created_at=self.now(), status="in_progress", model=model_name,
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            max_tool_calls=request.max_tool_calls,
            parallel_tool_calls=(True if request.parallel_tool_calls is None
                                 else request.parallel_tool_calls),
            previous_response_id=request.previous_response_id,
            reasoning=(request.reasoning.model_dump(mode="json")
                       if request.reasoning is not None else None),
            store=request.store is not False,
            temperature=1.0 if request.temperature is None else request.temperature,
            text=text, tool_choice=request.tool_choice or "auto", tools=list(request.tools or ()),
            top_logprobs=request.top_logprobs or 0,
            top_p=1.0 if request.top_p is None else request.top_p,
            truncation=request.truncation or "disabled", user=request.user,
            safety_identifier=request.safety_identifier,
            prompt_cache_key=request.prompt_cache_key, metadata=dict(request.metadata or {}))

    @staticmethod
    def _message(item_id: str, text: str, finish_reason: str | None,
                 logprobs: list | None) -> ResponseOutputMessage:
        status = "incomplete" if finish_reason == "length" else "completed"
        return ResponseOutputMessage(id=item_id, status=status, content=[
            ResponseOutputText(text=text, logprobs=logprobs)])

    @staticmethod
    def _close(base: ResponsesResponse, output: list[Any],
               finish_reason: str | None, num_input: int,
               num_output: int) -> ResponsesResponse:
        """``base`` finished: ``incomplete`` (``max_output_tokens``) when the length cut
        it, else ``completed``; with its output items and usage."""
        cut = finish_reason == "length"
        return base.model_copy(update=dict(
            status="incomplete" if cut else "completed",
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None,
            output=output,
            usage=ResponseUsage(input_tokens=num_input, output_tokens=num_output,
                                total_tokens=num_input + num_output)))

    def _finished(self, request: ResponsesRequest, base: ResponsesResponse,
                  final: RequestOutput, num_input: int, plan: ToolPlan) -> ResponsesResponse:
        """The finished response: a message item with the text (none when only calls
        were made), then a ``function_call`` item per call the plan reads out of it (the
        first ``max_tool_calls`` of them)."""
        out = final.outputs[0]
        logprobs = None
        if request.wants_logprobs() and out.logprobs is not None:
            logprobs = chat_logprobs(out.token_ids, out.logprobs,
                                     request.top_logprobs or 0).content
        chat_message, _ = plan.message(out.text, out.finish_reason)
        calls = (chat_message.tool_calls or [])[:request.max_tool_calls]
        output: list[Any] = []
        if chat_message.content or not calls:
            output.append(self._message(f"msg_{uuid.uuid4().hex}", chat_message.content or "",
                                        out.finish_reason, logprobs))
        status = "incomplete" if out.finish_reason == "length" else "completed"
        output += [ResponseFunctionToolCall(id=f"fc_{uuid.uuid4().hex}", call_id=call.id,
                                            name=call.function.name,
                                            arguments=call.function.arguments, status=status)
                   for call in calls]
        return self._close(base, output, out.finish_reason, num_input, len(out.token_ids))

    def _keep(self, request: ResponsesRequest, response: ResponsesResponse,
              conversation: list[dict[str, Any]]) -> None:
        """Store a finished response (with ``store``) and the conversation it ends."""
        if request.store is False:
            return
        self.store.put(response, [*conversation, *_messages(response.output)])

    async def _stream(self, request: ResponsesRequest, base: ResponsesResponse,
                      conversation: list[dict[str, Any]], num_input: int,
                      merged: MergedStream, plan: ToolPlan) -> AsyncIterator[str]:
        items = _StreamedItems(plan, request.max_tool_calls)
        seq = items.seq
        num_output = 0
        finish_reason = None
        wants_logprobs = request.wants_logprobs()
        try:
            yield response_event(ResponseCreatedEvent(sequence_number=next(seq),
                                                      response=base))
            yield response_event(ResponseInProgressEvent(sequence_number=next(seq),
                                                         response=base))
            if items.tools is None:
                for event in items.open_message():
                    yield event
            try:
                async for _, output in merged:
                    out = output.outputs[0]          # a DELTA output: only what is new
                    num_output += len(out.token_ids)
                    finish_reason = out.finish_reason or finish_reason
                    new_logprobs = []
                    if wants_logprobs and out.token_ids and out.logprobs is not None:
                        new_logprobs = chat_logprobs(out.token_ids, out.logprobs,
                                                     request.top_logprobs or 0).content
                    for event in items.feed(out.text, new_logprobs,
                                            out.finish_reason is not None):
                        yield event
            except Exception as e:
                for event in self._failure(e, base, seq):
                    yield event
                return
            for event in items.finish(finish_reason, wants_logprobs):
                yield event
            response = self._close(base, items.done, finish_reason, num_input, num_output)
            self._keep(request, response, conversation)
            yield response_event(ResponseCompletedEvent(sequence_number=next(seq),
                                                        response=response))
        finally:
            await self.finish_stream(merged)

    def _failure(self, exc: Exception, base: ResponsesResponse, seq) -> list[str]:
        """The ``error`` and ``response.failed`` events for an error met while streaming
        (logged when it is not an expected engine error)."""
        error = to_openai_error(exc)
        if error is None:
            logger.exception("a streamed response failed", exc_info=exc)
            error = OpenAIError(500, "internal server error")
        code = str(error.code)
        failed = base.model_copy(update=dict(
            status="failed", error=ResponseError(code=code, message=error.message)))
        return [response_event(ResponseErrorEvent(sequence_number=next(seq), code=code,
                                                  message=error.message, param=error.param)),
                response_event(ResponseFailedEvent(sequence_number=next(seq),
                                                   response=failed))]
