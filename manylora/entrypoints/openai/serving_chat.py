"""``POST /v1/chat/completions``: OpenAI's chat completions over ``AsyncLLM`` (vLLM's shape).

The messages are rendered with the tokenizer's chat template (or the server's
``--chat-template``) to text, which is then tokenized without special tokens: the template
carries the BOS, as in vLLM. Rendering and encoding run on the tokenization worker thread,
off the event loop. The ``n`` choices are each one engine request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from manylora.engine.outputs import RequestOutput
from manylora.entrypoints.openai.chat_template import (
    CONTENT_FORMATS,
    load_chat_template,
    render_messages,
    thinking_kwargs,
)
from manylora.entrypoints.openai.echo import chat_echo_text, prompt_logprobs_json
from manylora.entrypoints.openai.errors import bad_request
from manylora.entrypoints.openai.logprobs import chat_logprobs, clamp_logprob
from manylora.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
    UsageInfo,
)
from manylora.entrypoints.openai.protocol_structured import structured_params
from manylora.entrypoints.openai.reasoning_parsers import (
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
)
from manylora.entrypoints.openai.request_sampling import (
    child_sampling_params,
    request_sampling_params,
)
from manylora.entrypoints.openai.serving import OpenAIServing
from manylora.entrypoints.openai.serving_tools import DEFAULT_MAX_TOOLS, ToolPlan, ToolStream
from manylora.entrypoints.openai.sse import (
    SSE_DONE,
    chunk_event,
    sse_event,
    usage_info,
)
from manylora.entrypoints.openai.streams import (
    ChildRequest,
    MergedStream,
    guard_stream,
)
from manylora.entrypoints.openai.tool_parsers import get_tool_parser
from manylora.entrypoints.openai.vllm_fields import check_fields, response_ids, truncate_prompt

__all__ = ["OpenAIServingChat"]


@dataclass
class _ChoiceState:
    num_tokens: int = 0
    tools: ToolStream | None = None
    num_cached_tokens: int | None = None
    reasoning: ReasoningStream | None = None


def _prompt_fields(request: ChatCompletionRequest, prompt_ids: list[int],
                   prompt_text: str) -> dict[str, Any]:
    """The response's (or first chunk's) ``prompt_token_ids`` (``return_token_ids``) and
    ``prompt_text`` (``return_prompt_text``), those asked for."""
    fields: dict[str, Any] = {}
    if request.return_token_ids:
        fields["prompt_token_ids"] = list(prompt_ids)
    if request.return_prompt_text:
        fields["prompt_text"] = prompt_text
    return fields


class OpenAIServingChat(OpenAIServing):
    """The chat completions endpoint.

    Args:
        engine: an ``AsyncLLM``.
        models: the models registry (``base_model_name``, ``resolve(name)``).
        chat_template: a Jinja template (or a file holding one) used instead of the
            tokenizer's; None: the tokenizer's.
        trust_request_chat_template: accept a request's own ``chat_template`` (vLLM's
            ``--trust-request-chat-template``); otherwise such a request is a 400.
        enable_auto_tool_choice: serve ``tool_choice: "auto"`` (vLLM's
            ``--enable-auto-tool-choice``; needs ``tool_call_parser``).
        tool_call_parser: the format auto tool calls are read in (``--tool-call-parser``:
            ``hermes``, ``llama3_json``, ``mistral``), or None.
        max_tools: the most ``tools`` one request may carry (``--max-tools``; OpenAI's
            bound, 128, by default).
        reasoning_parser: the format reasoning is split out of answers in
            (``--reasoning-parser``: ``deepseek_r1``, ``qwen3``), or None.
        kwargs: ``max_choices``, ``prompt_tokenizer``, ``sampling_defaults`` and
            ``max_logprobs`` of :class:`OpenAIServing`.

    Raises:
        OSError: ``chat_template`` names a file that cannot be read.
        ValueError: an unknown ``tool_call_parser`` or ``reasoning_parser``, or
            ``enable_auto_tool_choice`` without a tool call parser.
    """

    def __init__(self, engine: Any, models: Any, chat_template: str | None = None,
                 trust_request_chat_template: bool = False,
                 enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 max_tools: int = DEFAULT_MAX_TOOLS, response_role: str = "assistant",
                 chat_template_content_format: str = "auto",
                 reasoning_parser: str | None = None, **kwargs: Any) -> None:
        super().__init__(engine, models, **kwargs)
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError("--chat-template-content-format must be one of "
                             f"{', '.join(CONTENT_FORMATS)}, got "
                             f"{chat_template_content_format!r}")
        self.response_role = response_role
        self.content_format = chat_template_content_format
        self.chat_template = load_chat_template(chat_template)
        self.trust_request_chat_template = trust_request_chat_template
        if tool_call_parser is not None:
            get_tool_parser(tool_call_parser)
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser
        self.max_tools = max_tools
        self.reasoning_parser = (None if reasoning_parser is None
                                 else get_reasoning_parser(reasoning_parser))

    def render(self, request: ChatCompletionRequest) -> str:
        """The messages as prompt text, through the chat template
        (:func:`~manylora.entrypoints.openai.chat_template.render_messages` with the
        server's ``--chat-template`` and ``--chat-template-content-format``).

        Raises:
            OpenAIError: 400 without a tokenizer, and ``render_messages``' 400s (no chat
                template, a non-text content part, a template failing on the messages).
        """
        tokenizer = self.require_tokenizer("chat", param="messages")
        return render_messages(tokenizer, request, self.chat_template, self.content_format)

    def render_and_encode(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The rendered prompt and its token ids (no special tokens added: the template
        carries them), with the length check on the rendered text before encoding it.
        Blocking: run it on the tokenization worker.

        Raises:
            OpenAIError: as :meth:`render`, and :meth:`encode_now`'s 400 and 413.
        """
        text = self.render(request)
        truncate = getattr(request, "truncate_prompt_tokens", None)
        ids = self.encode_now([text], add_special_tokens=bool(
            getattr(request, "add_special_tokens", False)), param="messages",
            check_length=truncate is None)[0]
        return text, truncate_prompt(ids, truncate, getattr(request, "truncation_side", None),
                                     self.max_model_len)

    async def create_chat_completion(
            self, request: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        """Run a chat completion request.

        Returns:
            The response, or for ``stream`` an async iterator of server-sent events (each
            choice's first chunk has ``delta {"role": "assistant", "content": ""}``; the
            last one its ``finish_reason``; then ``data: [DONE]\\n\\n``); an engine error
            after streaming began comes as one ``data: {"error": ...}`` event before
            ``[DONE]``. Closing the iterator (or cancelling its task) aborts the engine
            requests.

        Raises:
            OpenAIError: before anything is streamed: 400 for unsupported or invalid
                parameters, more choices (``n``) than ``max_choices``, a missing
                tokenizer or chat template, a failing template,
                ``max_tokens`` / ``max_completion_tokens`` past the context, or the
                engine's ``ValueError``; 404 for an unknown model; 413
                (``context_length_exceeded``) for messages filling the context; 503 when
                the engine is overloaded or stopped.
        """
        request.check()
        check_fields(request, "chat", self.trust_request_chat_template, self.max_logprobs)
        if request.tools and len(request.tools) > self.max_tools:
            raise bad_request(f"tools holds {len(request.tools)} functions; the server "
                              f"allows at most {self.max_tools} (--max-tools)", param="tools")
        tools = ToolPlan.for_request(request, self.tool_call_parser,
                                     self.enable_auto_tool_choice)
        structured, structured_param = structured_params(request)
        n = request.n or 1
        model_name, lora_request, bad_words = await self.admit(
            request.model, 1, n, needs_tokenizer=("chat", "messages"),
            grammars=[(structured, structured_param), (tools.structured, "tools")],
            bad_words=request.bad_words)
        text, token_ids = await self.prompts.run(self.render_and_encode, request)
        if not token_ids:
            raise bad_request("the messages rendered to an empty prompt", param="messages")
        requested, param = request.max_tokens_param()
        params = request_sampling_params(
            request, self.sampling_defaults, num_prompt_tokens=len(token_ids),
            max_model_len=self.max_model_len, max_tokens=requested,
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            prompt_logprobs=request.prompt_logprobs, structured=structured,
            bad_words=bad_words, prompt_param="messages", max_tokens_param=param)
        params = tools.apply(params)
        reasoning = self.reasoning_parser
        if structured is not None or tools.structured is not None:
            reasoning = None             # constrained from the first token: no thinking
        base_id, engine_id = response_ids("chatcmpl", request.request_id)
        children = [ChildRequest(f"{engine_id}-{i}", 0, token_ids, text, child_params,
                                 request.cache_salt)
                    for i, child_params in enumerate(child_sampling_params(params, n))]
        merged = await self.start(children, lora_request, client_group=engine_id)
        if request.stream:
            return guard_stream(self._stream(request, base_id, model_name, children, merged,
                                             tools, reasoning), merged)
        finals = await self.collect(merged)
        return self._response(request, base_id, model_name, finals, token_ids, text, tools,
                              reasoning)

    def _response(self, request: ChatCompletionRequest, base_id: str, model_name: str,
                  finals: list[RequestOutput], prompt_ids: list[int],
                  prompt_text: str, tools: ToolPlan,
                  reasoning: ReasoningParser | None) -> ChatCompletionResponse:
        choices = []
        completion_tokens = 0
        echo = chat_echo_text(request.echo, request.messages, request.add_generation_prompt)
        for index, final in enumerate(finals):
            out = final.outputs[0]
            completion_tokens += len(out.token_ids)
            logprobs = None
            if request.logprobs and out.logprobs is not None:
                logprobs = chat_logprobs(out.token_ids, out.logprobs, request.top_logprobs or 0,
                                         bool(request.return_tokens_as_token_ids))
            thought, text = None, out.text
            if reasoning is not None:
                thought, text = reasoning.split(out.text, prompt_text,
                                                thinking_kwargs(request))
            message, finish_reason = tools.message(text or "", out.finish_reason)
            if text is None and message.content == "":
                message.content = None   # vLLM's: nothing after </think>
            if request.include_reasoning is not False:
                message.reasoning_content = thought
            message.role = self.role_of(request)
            if echo:
                message.content = echo + (message.content or "")
            choices.append(ChatCompletionResponseChoice(
                index=index, message=message, logprobs=logprobs, finish_reason=finish_reason,
                stop_reason=out.stop_reason,
                token_ids=list(out.token_ids) if request.return_token_ids else None))
        return ChatCompletionResponse(
            id=base_id, created=self.now(), model=model_name, choices=choices,
            usage=usage_info(len(prompt_ids), completion_tokens, self.cached_tokens(
                [finals[0].num_cached_tokens] if finals else [])),
            prompt_logprobs=prompt_logprobs_json(
                finals[0].prompt_logprobs if finals else None, clamp_logprob),
            **_prompt_fields(request, prompt_ids, prompt_text))

    def role_of(self, request: ChatCompletionRequest) -> str:
        """The role of the answer, as vLLM's: ``--response-role`` when the request adds a
        generation prompt, else the last message's (the answer continues it)."""
        if request.add_generation_prompt:
            return self.response_role
        return request.messages[-1].role

    async def _stream(self, request: ChatCompletionRequest, base_id: str, model_name: str,
                      children: list[ChildRequest], merged: MergedStream,
                      tools: ToolPlan, reasoning: ReasoningParser | None
                      ) -> AsyncIterator[str]:
        created = self.now()
        options = request.stream_options
        num_prompt_tokens = len(children[0].prompt_token_ids)
        states = [_ChoiceState(tools=tools.stream(), reasoning=None if reasoning is None else
                               reasoning.stream(children[0].prompt_text or "",
                                                thinking_kwargs(request)))
                  for _ in children]
        echo = chat_echo_text(request.echo, request.messages, request.add_generation_prompt)
        prompt = _prompt_fields(request, children[0].prompt_token_ids,
                                children[0].prompt_text or "")

        def _usage() -> UsageInfo:
            return usage_info(num_prompt_tokens, sum(s.num_tokens for s in states),
                              self.cached_tokens([states[0].num_cached_tokens]))

        try:
            try:
                for index in range(len(children)):
                    first = ChatCompletionStreamResponse(
                        id=base_id, created=created, model=model_name,
                        choices=[ChatCompletionStreamChoice(
                            index=index, delta=DeltaMessage(role=self.role_of(request),
                                                            content=""))],
                        **(prompt if index == 0 else {}))
                    yield chunk_event(first, options, _usage())
                    if echo:
                        yield chunk_event(ChatCompletionStreamResponse(
                            id=base_id, created=created, model=model_name,
                            choices=[ChatCompletionStreamChoice(
                                index=index, delta=DeltaMessage(content=echo))]),
                            options, _usage())
                async for index, output in merged:
                    event = self._chunk(request, base_id, created, model_name, index,
                                        states[index], output)
                    if event is not None:
                        yield chunk_event(event, options, _usage())
                if options is not None and options.include_usage:
                    yield sse_event(ChatCompletionStreamResponse(
                        id=base_id, created=created, model=model_name, choices=[],
                        usage=_usage()))
            except Exception as e:
                yield self.stream_error(e)
            yield SSE_DONE
        finally:
            await self.finish_stream(merged)

    @staticmethod
    def _chunk(request: ChatCompletionRequest, base_id: str, created: int, model_name: str,
               index: int, state: _ChoiceState,
               output: RequestOutput) -> ChatCompletionStreamResponse | None:
        """The chunk for a choice's new output; None when it brings nothing to send."""
        out = output.outputs[0]          # a DELTA output: only what is new
        finished = out.finish_reason is not None
        text = out.text
        thought = ""
        if state.reasoning is not None:
            thought, text = state.reasoning.feed(text, finished)
        delta = DeltaMessage(content=text or None)
        finish_reason = out.finish_reason
        if state.tools is not None:
            delta = state.tools.delta(text, finished)
            finish_reason = state.tools.plan.finish_reason(state.tools.called, finish_reason)
        if thought and request.include_reasoning is not False:
            delta.reasoning_content = thought
        new_ids = out.token_ids
        logprobs = None
        if request.logprobs and new_ids and out.logprobs is not None:
            logprobs = chat_logprobs(new_ids, out.logprobs, request.top_logprobs or 0,
                                     bool(request.return_tokens_as_token_ids))
        state.num_tokens += len(new_ids)
        if output.num_cached_tokens is not None:
            state.num_cached_tokens = output.num_cached_tokens
        if (delta.content is None and not delta.tool_calls and logprobs is None
                and delta.reasoning_content is None
                and not finished and not (request.return_token_ids and new_ids)):
            return None
        return ChatCompletionStreamResponse(
            id=base_id, created=created, model=model_name,
            choices=[ChatCompletionStreamChoice(
                index=index, delta=delta, logprobs=logprobs,
                finish_reason=finish_reason, stop_reason=out.stop_reason,
                token_ids=list(new_ids) if request.return_token_ids else None)])
