"""``POST /v1/completions``: OpenAI's legacy completions over ``AsyncLLM`` (vLLM's shape).

Every prompt gets ``n`` choices (choice index ``prompt_index * n + i``), each one engine
request; they run concurrently and stream as they come. Log-probabilities follow vLLM:
per generated token its text, its log-probability, a ``{token: logprob}`` map of the ``N``
most likely tokens plus the sampled one, and its character offset in the generated text.
``echo``, ``max_tokens: 0`` and ``prompt_logprobs`` as vLLM (``echo.py``): the echoed
prompt's tokens lead the log-probabilities, the first one's null.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from manylora.engine.outputs import RequestOutput
from manylora.entrypoints.openai.echo import (
    echo_without_generation,
    engine_max_tokens,
    engine_prompt_logprobs,
    prompt_logprobs_json,
)
from manylora.entrypoints.openai.errors import bad_request
from manylora.entrypoints.openai.logprobs import (
    clamp_logprob,
    completion_logprobs,
    decoded_token,
    token_text,
)
from manylora.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
)
from manylora.entrypoints.openai.protocol_structured import structured_params
from manylora.entrypoints.openai.request_sampling import (
    child_sampling_params,
    request_sampling_params,
)
from manylora.entrypoints.openai.serving import OpenAIServing
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
from manylora.entrypoints.openai.vllm_fields import check_fields, response_ids, truncate_prompt

__all__ = ["OpenAIServingCompletion"]


def _prompt_items(raw: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a request's ``prompt``: one text, texts, one token-id list, or
    token-id lists (no tokenization, so the count is known at once)."""
    if isinstance(raw, str):
        return [raw]
    if raw and all(isinstance(t, int) for t in raw):
        return [list(raw)]
    return list(raw)


@dataclass
class _Prompt:
    token_ids: list[int]
    text: str | None


@dataclass
class _ChoiceState:
    echo: str | None
    prompt_ids: list[int] | None     # None once a chunk has carried them
    num_tokens: int = 0
    offset: int = 0
    num_cached_tokens: int | None = None


def _token_ids(request: CompletionRequest, prompt_ids: list[int] | None,
               token_ids: Sequence[int]) -> dict[str, list[int] | None]:
    """vLLM's ``return_token_ids`` fields of a choice (or a chunk of it): the prompt's ids
    and the (new) generated ids; nothing without it."""
    if not request.return_token_ids:
        return {}
    return {"prompt_token_ids": prompt_ids, "token_ids": list(token_ids)}


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint.

    Args:
        engine: an ``AsyncLLM``.
        models: the models registry (``base_model_name``, ``resolve(name)``).
    """

    async def create_completion(
            self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """Run a completion request.

        Returns:
            The response, or for ``stream`` an async iterator of server-sent events
            (``data: {chunk}\\n\\n`` ..., ``data: [DONE]\\n\\n``); an engine error after
            streaming began comes as one ``data: {"error": ...}`` event before ``[DONE]``.
            Closing the iterator (or cancelling its task) aborts the engine requests.

        Raises:
            OpenAIError: before anything is streamed: 400 for unsupported or invalid
                parameters, more choices (prompts x ``n``) than ``max_choices`` (checked
                before tokenizing), an empty or untokenizable prompt, ``max_tokens`` past the
                context, or the engine's ``ValueError``; 404 for an unknown model; 413
                (``context_length_exceeded``) for a prompt filling the context; 503 when
                the engine is overloaded or stopped.
        """
        request.check()
        check_fields(request, "completion", max_logprobs=self.max_logprobs)
        structured, structured_param = structured_params(request)
        n = request.n or 1
        items = _prompt_items(request.prompt)
        model_name, lora_request, bad_words = await self.admit(
            request.model, len(items), n, grammars=[(structured, structured_param)],
            bad_words=request.bad_words)
        prompts = await self._prompts(items, request)
        base_id, engine_id = response_ids("cmpl", request.request_id)
        children: list[ChildRequest] = []
        for p, prompt in enumerate(prompts):
            params = request_sampling_params(
                request, self.sampling_defaults, num_prompt_tokens=len(prompt.token_ids),
                max_model_len=self.max_model_len,
                max_tokens=engine_max_tokens(request.echo, request.max_tokens),
                logprobs=request.logprobs,
                prompt_logprobs=engine_prompt_logprobs(request.prompt_logprobs, request.echo,
                                                       request.logprobs),
                structured=structured, bad_words=bad_words)
            for i, child_params in enumerate(child_sampling_params(params, n)):
                children.append(ChildRequest(f"{engine_id}-{p * n + i}", p, prompt.token_ids,
                                             prompt.text, child_params, request.cache_salt))
        if request.echo and any(p.text is None for p in prompts):
            self.require_tokenizer("echo of a token-id prompt", param="echo")
        merged = await self.start(children, lora_request, client_group=engine_id)
        try:                             # after the engine has checked the token ids
            echoes = (await self.prompts.run(self._echo_texts, request, prompts)
                      if request.echo else [None] * len(prompts))
        except BaseException:
            merged.close()
            raise
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        if request.stream:
            stream = self._stream(request, base_id, model_name, children, echoes, merged,
                                  num_prompt_tokens)
            return guard_stream(stream, merged)
        finals = await self.collect(merged)
        return self._response(request, base_id, model_name, children, echoes, finals,
                              num_prompt_tokens)

    async def _prompts(self, items: list[str | list[int]],
                       request: CompletionRequest) -> list[_Prompt]:
        """The prompts, the texts tokenized (on the tokenization worker, with special
        tokens unless ``add_special_tokens`` is false), each cut to
        ``truncate_prompt_tokens`` (a truncated prompt's text is dropped: echo decodes
        the ids kept).

        Raises:
            OpenAIError: 400 (``prompt``) for an empty prompt, token ids outside the
                model's vocabulary, a text prompt without a tokenizer, a
                ``truncate_prompt_tokens`` over the context; 413 for a text certainly
                longer than the context (not checked when it is truncated).
        """
        vocab = getattr(getattr(self.engine, "engine", None), "vocab_size", None)
        truncate = request.truncate_prompt_tokens
        texts = [item for item in items if isinstance(item, str)]
        encoded = iter(await self.tokenize(
            texts, add_special_tokens=request.add_special_tokens is not False, param="prompt",
            check_length=truncate is None) if texts else [])
        prompts = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                prompt = _Prompt(next(encoded), item)
            else:
                prompt = _Prompt(list(item), None)
            where = "" if len(items) == 1 else f" {i}"
            ids = truncate_prompt(prompt.token_ids, truncate, request.truncation_side,
                                  self.max_model_len)
            if len(ids) != len(prompt.token_ids):
                prompt = _Prompt(ids, None)
            if not prompt.token_ids:
                raise bad_request(f"prompt{where} is empty", param="prompt")
            bad = [t for t in prompt.token_ids if vocab is not None and not 0 <= t < vocab]
            if bad:
                raise bad_request(f"prompt{where} holds token ids {bad[:5]} outside the "
                                  f"vocabulary [0, {vocab})", param="prompt")
            prompts.append(prompt)
        return prompts

    def _echo_texts(self, request: CompletionRequest,
                    prompts: list[_Prompt]) -> list[str | None]:
        """Per prompt, the text ``echo`` puts before its choices (None without echo). Called
        once the engine has accepted the prompts, so token ids are inside the vocabulary;
        blocking (token ids are decoded): run it on the tokenization worker.

        Raises:
            OpenAIError: 400 when a token-id prompt must be echoed without a tokenizer.
        """
        if not request.echo:
            return [None] * len(prompts)
        texts = []
        for prompt in prompts:
            if prompt.text is None:
                tokenizer = self.require_tokenizer("echo of a token-id prompt", param="echo")
                texts.append(tokenizer.decode(prompt.token_ids))
            else:
                texts.append(prompt.text)
        return texts

    def _token_piece(self, token_id: int) -> str | None:
        """A token's text alone (as ``Logprob.decoded_token``), for the prompt's first
        token, which has no log-probability entry; None without a tokenizer."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None
        piece = tokenizer.convert_ids_to_tokens(token_id)
        return "" if piece is None else tokenizer.convert_tokens_to_string([piece])

    def _response(self, request: CompletionRequest, base_id: str, model_name: str,
                  children: list[ChildRequest], echoes: list[str | None],
                  finals: list[RequestOutput], num_prompt_tokens: int) -> CompletionResponse:
        choices = []
        completion_tokens = 0
        drop = echo_without_generation(request.echo, request.max_tokens)
        for index, (child, final) in enumerate(zip(children, finals)):
            out = final.outputs[0]
            token_ids, steps, text = ([], [], "") if drop else (
                out.token_ids, out.logprobs, out.text)
            completion_tokens += len(token_ids)
            if request.echo and steps is not None and request.logprobs is not None:
                token_ids = child.prompt_token_ids + token_ids
                steps = [*(final.prompt_logprobs or [None] * len(child.prompt_token_ids)),
                         *steps]
            logprobs = None
            if request.logprobs is not None and steps is not None:
                logprobs = completion_logprobs(
                    token_ids, steps, request.logprobs,
                    as_token_ids=bool(request.return_tokens_as_token_ids),
                    decode=self._token_piece)
            echo = echoes[child.prompt_index] or ""
            choices.append(CompletionResponseChoice(
                index=index, text=echo + text, logprobs=logprobs,
                finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs, clamp_logprob),
                **_token_ids(request, child.prompt_token_ids, [] if drop else out.token_ids)))
        return CompletionResponse(id=base_id, created=self.now(), model=model_name,
                                  choices=choices,
                                  usage=usage_info(num_prompt_tokens, completion_tokens,
                                                   self._cached(children, finals)))

    def _cached(self, children: list[ChildRequest],
                outputs: Sequence[RequestOutput | _ChoiceState]) -> int | None:
        """The usage's cached prompt tokens: each prompt's first choice's
        ``num_cached_tokens`` (a ``RequestOutput``'s or a stream state's), summed."""
        first: dict[int, int | None] = {}
        for child, out in zip(children, outputs):
            first.setdefault(child.prompt_index, out.num_cached_tokens)
        return self.cached_tokens(list(first.values()))

    async def _stream(self, request: CompletionRequest, base_id: str, model_name: str,
                      children: list[ChildRequest], echoes: list[str | None],
                      merged: MergedStream, num_prompt_tokens: int) -> AsyncIterator[str]:
        created = self.now()
        options = request.stream_options
        states = [_ChoiceState(echoes[c.prompt_index], c.prompt_token_ids) for c in children]

        def _usage() -> UsageInfo:
            return usage_info(num_prompt_tokens, sum(s.num_tokens for s in states),
                              self._cached(children, states))

        try:
            try:
                async for index, output in merged:
                    event = self._chunk(request, base_id, created, model_name, index,
                                        states[index], output, self._token_piece)
                    if event is not None:
                        yield chunk_event(event, options, _usage())
                if options is not None and options.include_usage:
                    yield sse_event(CompletionStreamResponse(
                        id=base_id, created=created, model=model_name, choices=[],
                        usage=_usage()))
            except Exception as e:
                yield self.stream_error(e)
            yield SSE_DONE
        finally:
            await self.finish_stream(merged)

    @staticmethod
    def _chunk(request: CompletionRequest, base_id: str, created: int, model_name: str,
               index: int, state: _ChoiceState, output: RequestOutput,
               decode: Callable[[int], str | None] | None = None
               ) -> CompletionStreamResponse | None:
        """The chunk for a choice's new output; None when it brings no new token (a chunk
        whose text is empty still marks a token's arrival, as vLLM's: held back for a stop
        string, an incomplete UTF-8 character, or no tokenizer). The first chunk of an
        echoed choice leads with the prompt (its tokens' log-probabilities too); with
        ``max_tokens: 0`` the generated token is dropped."""
        out = output.outputs[0]          # a DELTA output: only what is new
        finished = out.finish_reason is not None
        drop = echo_without_generation(request.echo, request.max_tokens)
        text, new_ids, steps = ("", [], []) if drop else (
            out.text, out.token_ids, out.logprobs)
        count, generated = len(new_ids), new_ids
        if state.echo is not None:
            text, state.echo = state.echo + text, None
            if request.logprobs is not None and steps is not None:
                prompt = output.prompt_logprobs or [None] * len(state.prompt_ids)
                new_ids, steps = state.prompt_ids + new_ids, [*prompt, *steps]
        logprobs = None
        if request.logprobs is not None and new_ids and steps is not None:
            logprobs = completion_logprobs(new_ids, steps, request.logprobs, state.offset,
                                           bool(request.return_tokens_as_token_ids), decode)
            state.offset += sum(
                len(token_text(t, decoded_token(e, t) if e is not None or decode is None
                               else decode(t)))
                for t, e in zip(new_ids, steps))
        state.num_tokens += count
        if output.num_cached_tokens is not None:
            state.num_cached_tokens = output.num_cached_tokens
        if not text and not new_ids and not finished:
            return None
        ids = _token_ids(request, state.prompt_ids, generated)
        state.prompt_ids = None          # the prompt's ids go in a choice's first chunk
        return CompletionStreamResponse(
            id=base_id, created=created, model=model_name,
            choices=[CompletionStreamChoice(index=index, text=text, logprobs=logprobs,
                                            finish_reason=out.finish_reason,
                                            stop_reason=out.stop_reason, **ids)])
