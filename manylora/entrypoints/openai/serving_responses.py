"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API for text and
function tools over ``AsyncLLM`` (vLLM's ``serving_responses`` without hosted tools and
reasoning).

The input (``instructions`` as a leading system message, the stored conversation of
``previous_response_id``, then ``input``) is rendered through the chat template and
tokenized on the tokenization worker thread exactly as ``/v1/chat/completions`` renders
messages (the chat endpoint's :meth:`~OpenAIServingChat.render_and_encode`), so the same
greedy request gives the same text on both routes; ``function_call`` and
``function_call_output`` items become an assistant message's ``tool_calls`` and ``tool``
messages (``responses_request.py``). Function ``tools`` (flat, converted to the chat
route's shape) and ``tool_choice`` go through the chat route's
:class:`~manylora.entrypoints.openai.serving_tools.ToolPlan`: the same
``--tool-call-parser`` for ``auto``, the same grammar for ``required`` and a named
function; each call is a ``function_call`` output item. One engine request per response,
its own fairness group. Streamed, the events are OpenAI's (``response.created``,
``response.in_progress``, then each output item's events: ``responses_events.py``, then
``response.completed``). An engine error after the first event ends the stream with
``error`` and ``response.failed``.

With ``store`` (OpenAI's default) the finished response and its conversation are kept in
memory (``responses_store.py``), for ``GET /v1/responses/{id}`` and
``previous_response_id``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from manylora.engine.outputs import RequestOutput
from manylora.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    not_found,
    to_openai_error,
)
from manylora.entrypoints.openai.logprobs import chat_logprobs
from manylora.entrypoints.openai.protocol import ChatCompletionRequest
from manylora.entrypoints.openai.protocol_responses import (
    IncompleteDetails,
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseError,
    ResponseErrorEvent,
    ResponseFailedEvent,
    ResponseFunctionToolCall,
    ResponseInProgressEvent,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from manylora.entrypoints.openai.request_sampling import check_context_length
from manylora.entrypoints.openai.responses_events import (
    StreamedItems,
    output_message,
    response_event,
)
from manylora.entrypoints.openai.responses_request import (
    as_chat_request,
    chat_messages,
    input_messages,
    sampling_params,
)
from manylora.entrypoints.openai.responses_store import ResponseStore
from manylora.entrypoints.openai.serving import OpenAIServing
from manylora.entrypoints.openai.serving_chat import OpenAIServingChat
from manylora.entrypoints.openai.serving_tools import ToolPlan
from manylora.entrypoints.openai.streams import ChildRequest, MergedStream, guard_stream

logger = logging.getLogger(__name__)

__all__ = ["OpenAIServingResponses"]


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
        return history + input_messages(request)

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
        chat_request = as_chat_request(request, conversation)
        plan = ToolPlan.for_request(chat_request, self.chat.tool_call_parser,
                                    self.chat.enable_auto_tool_choice)
        self.require_tokenizer("/v1/responses", param="input")
        await self.check_structured(plan.structured, "tools")
        text, token_ids = await self.prompts.run(self._render_and_encode, chat_request)
        if not token_ids:
            raise bad_request("the input rendered to an empty prompt", param="input")
        token_ids, max_tokens = self._fit(request, token_ids)
        params = plan.apply(sampling_params(request, max_tokens, self.max_spec_bytes))
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
            output.append(output_message(f"msg_{uuid.uuid4().hex}",
                                         chat_message.content or "", out.finish_reason,
                                         logprobs))
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
        self.store.put(response, [*conversation, *chat_messages(response.output)])

    async def _stream(self, request: ResponsesRequest, base: ResponsesResponse,
                      conversation: list[dict[str, Any]], num_input: int,
                      merged: MergedStream, plan: ToolPlan) -> AsyncIterator[str]:
        items = StreamedItems(plan, request.max_tool_calls)
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
