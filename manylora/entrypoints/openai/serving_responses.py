"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API for text over
``AsyncLLM`` (vLLM's ``serving_responses`` without tools and reasoning).

The input (``instructions`` as a leading system message, the stored conversation of
``previous_response_id``, then ``input``) is rendered through the chat template and
tokenized on the tokenization worker thread exactly as ``/v1/chat/completions`` renders
messages (the chat endpoint's :meth:`~OpenAIServingChat.render_and_encode`), so the same
greedy request gives the same text on both routes. One engine request per response, its own
fairness group. Streamed, the events are OpenAI's (``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, ``response.completed``), each
with its ``sequence_number``, framed ``event: <type>`` / ``data: <json>``; an engine error
after the first event ends the stream with ``error`` and ``response.failed``.

With ``store`` (OpenAI's default) the finished response and its conversation are kept in
memory (:class:`ResponseStore`, bounded, least recently used dropped first, as vLLM keeps
them in memory), for ``GET /v1/responses/{id}`` and ``previous_response_id``.
"""

from __future__ import annotations

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
    conversation: list[dict[str, str]]
    chars: int


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

    def put(self, response: ResponsesResponse, conversation: list[dict[str, str]]) -> None:
        """Keep ``response`` and its ``conversation`` (dropping the least recently used
        entries over the bounds; a conversation larger than ``max_chars`` is not kept)."""
        chars = sum(len(m["content"]) for m in conversation)
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

    def get(self, response_id: str) -> tuple[ResponsesResponse, list[dict[str, str]]] | None:
        """The stored response and conversation, or None."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            self._entries.move_to_end(response_id)
            return entry.response, entry.conversation


def _input_messages(request: ResponsesRequest) -> list[dict[str, str]]:
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    return [{"role": m.role, "content": m.text()} for m in request.input]


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

    def _conversation(self, request: ResponsesRequest) -> list[dict[str, str]]:
        """The previous response's conversation (if any) and this input.

        Raises:
            OpenAIError: 404 (``previous_response_id``) for an id not stored.
        """
        history: list[dict[str, str]] = []
        if request.previous_response_id is not None:
            found = self.store.get(request.previous_response_id)
            if found is None:
                raise not_found(f"no stored response with id "
                                f"{request.previous_response_id!r}",
                                param="previous_response_id")
            history = list(found[1])
        return history + _input_messages(request)

    def _render_and_encode(self, request: ResponsesRequest,
                           conversation: list[dict[str, str]]) -> tuple[str, list[int]]:
        """The prompt text and ids, through the chat endpoint (blocking: run it on the
        tokenization worker); its errors name ``input``."""
        messages = [{"role": "system", "content": request.instructions}] \
            if request.instructions is not None else []
        chat_request = ChatCompletionRequest(
            messages=[ChatCompletionMessageParam(**m) for m in messages + conversation],
            chat_template_kwargs=request.chat_template_kwargs)
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
        self.check_choices(1, 1)
        model_name, lora_request = self.resolve_model(request.model)
        conversation = self._conversation(request)
        self.require_tokenizer("/v1/responses", param="input")
        text, token_ids = await self.prompts.run(self._render_and_encode, request,
                                                 conversation)
        if not token_ids:
            raise bad_request("the input rendered to an empty prompt", param="input")
        token_ids, max_tokens = self._fit(request, token_ids)
        params = self._sampling_params(request, max_tokens)
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
                                             merged), merged)
        final = (await self.collect(merged))[-1]
        response = self._finished(request, base, final, len(token_ids))
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
            text=text, tool_choice=request.tool_choice or "auto",
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
    def _close(base: ResponsesResponse, message: ResponseOutputMessage,
               finish_reason: str | None, num_input: int,
               num_output: int) -> ResponsesResponse:
        """``base`` finished: ``incomplete`` (``max_output_tokens``) when the length cut
        it, else ``completed``; with its output and usage."""
        cut = finish_reason == "length"
        return base.model_copy(update=dict(
            status="incomplete" if cut else "completed",
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None,
            output=[message],
            usage=ResponseUsage(input_tokens=num_input, output_tokens=num_output,
                                total_tokens=num_input + num_output)))

    def _finished(self, request: ResponsesRequest, base: ResponsesResponse,
                  final: RequestOutput, num_input: int) -> ResponsesResponse:
        out = final.outputs[0]
        logprobs = None
        if request.wants_logprobs() and out.logprobs is not None:
            logprobs = chat_logprobs(out.token_ids, out.logprobs,
                                     request.top_logprobs or 0).content
        message = self._message(f"msg_{uuid.uuid4().hex}", out.text, out.finish_reason,
                                logprobs)
        return self._close(base, message, out.finish_reason, num_input, len(out.token_ids))

    def _keep(self, request: ResponsesRequest, response: ResponsesResponse,
              conversation: list[dict[str, str]]) -> None:
        """Store a finished response (with ``store``) and the conversation it ends."""
        if request.store is False:
            return
        reply = {"role": "assistant", "content": response.output_text()}
        self.store.put(response, [*conversation, reply])

    async def _stream(self, request: ResponsesRequest, base: ResponsesResponse,
                      conversation: list[dict[str, str]], num_input: int,
                      merged: MergedStream) -> AsyncIterator[str]:
        seq = iter(range(2**62))
        item_id = f"msg_{uuid.uuid4().hex}"
        where = dict(item_id=item_id, output_index=0, content_index=0)
        texts: list[str] = []
        logprobs: list = []
        num_output = 0
        finish_reason = None
        wants_logprobs = request.wants_logprobs()
        try:
            yield response_event(ResponseCreatedEvent(sequence_number=next(seq),
                                                      response=base))
            yield response_event(ResponseInProgressEvent(sequence_number=next(seq),
                                                         response=base))
            empty = ResponseOutputMessage(id=item_id, status="in_progress", content=[])
            yield response_event(ResponseOutputItemAddedEvent(
                sequence_number=next(seq), output_index=0, item=empty))
            yield response_event(ResponseContentPartAddedEvent(
                sequence_number=next(seq), part=ResponseOutputText(text=""), **where))
            try:
                async for _, output in merged:
                    out = output.outputs[0]          # a DELTA output: only what is new
                    num_output += len(out.token_ids)
                    finish_reason = out.finish_reason or finish_reason
                    new_logprobs = []
                    if wants_logprobs and out.token_ids and out.logprobs is not None:
                        new_logprobs = chat_logprobs(out.token_ids, out.logprobs,
                                                     request.top_logprobs or 0).content
                        logprobs += new_logprobs
                    if out.text or new_logprobs:
                        texts.append(out.text)
                        yield response_event(ResponseTextDeltaEvent(
                            sequence_number=next(seq), delta=out.text,
                            logprobs=new_logprobs, **where))
            except Exception as e:
                for event in self._failure(e, base, seq):
                    yield event
                return
            text = "".join(texts)
            message = self._message(item_id, text, finish_reason,
                                    logprobs if wants_logprobs else None)
            part = message.content[0]
            yield response_event(ResponseTextDoneEvent(
                sequence_number=next(seq), text=text, logprobs=logprobs, **where))
            yield response_event(ResponseContentPartDoneEvent(
                sequence_number=next(seq), part=part, **where))
            yield response_event(ResponseOutputItemDoneEvent(
                sequence_number=next(seq), output_index=0, item=message))
            response = self._close(base, message, finish_reason, num_input, num_output)
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
