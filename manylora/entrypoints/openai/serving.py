"""``OpenAIServing``: the base of the completions, chat, Responses and tokenizer endpoints,
holding the engine and the models registry, and the checks and start-up every request goes
through in order: the bound on the choices of one request (prompts x ``n``, checked before
anything is tokenized), model lookup, grammar and ``bad_words`` bounds, tokenization off
the event loop (``tokenization.py``) after a length check that needs no tokenizer, and
starting the engine requests of one HTTP request (``n`` choices per prompt, each its own
engine request, as vLLM's parallel sampling), merged into one stream (``streams.py``).

Every check of a request runs before its stream is handed back, so a bad request gets its
own status code; an error after streaming began is sent as one ``data: {"error": ...}``
event before ``data: [DONE]`` (:meth:`OpenAIServing.stream_error`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from manylora.engine.outputs import RequestOutput
from manylora.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    to_openai_error,
    too_large,
)
from manylora.entrypoints.openai.request_logger import RequestLogger
from manylora.entrypoints.openai.sse import sse_error
from manylora.entrypoints.openai.streams import ChildRequest, MergedStream
from manylora.entrypoints.openai.tokenization import PromptTokenizer
from manylora.lora_request import LoRARequest
from manylora.sampling_params import MAX_LOGPROBS
from manylora.structured.bad_words import (
    DEFAULT_MAX_BAD_WORDS,
    bad_words_token_ids,
    check_bad_words,
)
from manylora.structured.grammar import (
    DEFAULT_MAX_SPEC_BYTES,
    check_spec_size,
    check_structured_outputs,
)
from manylora.structured_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_CHOICES_PER_REQUEST", "OpenAIServing"]

#: The most choices (engine requests: prompts x ``n``) one HTTP request may ask for by
#: default (``--max-choices-per-request``): room for an evaluation harness's batches, and a
#: bound on what one request body can make the server do.
DEFAULT_MAX_CHOICES_PER_REQUEST = 1024


class OpenAIServing:
    """Base of the endpoint classes: the engine, the models registry and the checks and
    start-up every request goes through.

    Args:
        engine: an ``AsyncLLM`` (``tokenizer``, ``max_model_len``, ``generate``, ``abort``).
        models: has ``base_model_name`` and ``resolve(name) -> LoRARequest | None``
            (raising a 404 ``OpenAIError`` for an unknown name).
        max_choices: the most engine requests (prompts x ``n``) one HTTP request may
            create (``--max-choices-per-request``).
        prompt_tokenizer: the tokenization worker to share with the other endpoint (one
            thread per server); None: one of its own over ``engine.tokenizer``.
        sampling_defaults: the server's defaults of the sampling fields a request leaves
            unset (``--generation-config``: ``temperature``, ``top_p``, ``top_k``,
            ``min_p``, ``repetition_penalty``; ``max_tokens`` caps every request's).
        max_logprobs: the most log-probabilities per token a request may ask for
            (``--max-logprobs``).

    Attributes:
        request_logger: logs each engine request as it starts (``--enable-log-requests``);
            None: no log.

    Raises:
        ValueError: ``max_choices`` below 1.
    """

    request_logger: RequestLogger | None = None

    def __init__(self, engine: Any, models: Any, *,
                 max_choices: int = DEFAULT_MAX_CHOICES_PER_REQUEST,
                 prompt_tokenizer: PromptTokenizer | None = None,
                 sampling_defaults: Mapping[str, Any] | None = None,
                 max_logprobs: int = MAX_LOGPROBS,
                 enable_prompt_tokens_details: bool = False) -> None:
        if max_choices < 1:
            raise ValueError(f"max_choices must be at least 1, got {max_choices}")
        self.sampling_defaults = dict(sampling_defaults or {})
        self.max_logprobs = max_logprobs
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.engine = engine
        self.models = models
        self.max_choices = max_choices
        self.prompts = (prompt_tokenizer if prompt_tokenizer is not None
                        else PromptTokenizer(getattr(engine, "tokenizer", None)))
        self.max_spec_bytes = getattr(engine, "max_structured_output_spec_bytes",
                                      DEFAULT_MAX_SPEC_BYTES)
        self.max_bad_words = getattr(engine, "max_bad_words", DEFAULT_MAX_BAD_WORDS)

    def cached_tokens(self, counts: Sequence[int | None]) -> int | None:
        """``usage.prompt_tokens_details.cached_tokens`` of one request's prompts (each
        prompt's ``RequestOutput.num_cached_tokens``, summed) under
        ``--enable-prompt-tokens-details`` (vLLM's); None without it."""
        if not self.enable_prompt_tokens_details:
            return None
        return sum(c or 0 for c in counts)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer text prompts are encoded with, or None."""
        return self.prompts.tokenizer

    @property
    def max_model_len(self) -> int:
        """The context length in tokens."""
        return int(self.engine.max_model_len)

    def resolve_model(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """The name to report and the adapter for a request's ``model`` (None or one of the
        base model's names: no adapter, reported by its first name, as vLLM does).

        Raises:
            OpenAIError: 404 for an unknown model.
        """
        if name is None or name == "":
            return self.models.base_model_name, None
        lora_request = self.models.resolve(name)
        return (name if lora_request is not None else self.models.base_model_name), lora_request

    def check_choices(self, num_prompts: int, n: int) -> None:
        """Bound the engine requests of one HTTP request: ``num_prompts * n`` at most
        ``max_choices``. Runs before anything is tokenized or sent to the engine.

        Raises:
            OpenAIError: 400 naming ``prompt`` (too many prompts even with ``n=1``) or
                ``n``, with the numbers.
        """
        if num_prompts * n <= self.max_choices:
            return
        param = "prompt" if num_prompts > self.max_choices else "n"
        raise bad_request(
            f"this request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} "
            f"choices; the server allows at most {self.max_choices} per request "
            "(--max-choices-per-request). Split it into several requests.", param=param)

    async def admit(self, model: str | None, num_prompts: int, n: int, *,
                    grammars: Sequence[tuple[StructuredOutputsParams | None, str | None]] = (),
                    bad_words: list[str] | None = None,
                    needs_tokenizer: tuple[str, str] | None = None
                    ) -> tuple[str, LoRARequest | None, list[list[int]] | None]:
        """The checks a generation request passes before its prompt is tokenized, in this
        order: the choices bound (:meth:`check_choices`), the model (:meth:`resolve_model`),
        the tokenizer when ``needs_tokenizer`` (what, param) asks for one, each grammar of
        ``grammars`` ((params, param) pairs: :meth:`check_structured`), then ``bad_words``
        (:meth:`bad_words_ids`).

        Returns:
            The model name to report, the adapter (None: the base model), and the
            ``bad_words`` as token ids (None for none).

        Raises:
            OpenAIError: the first check's error (400, 404).
        """
        self.check_choices(num_prompts, n)
        model_name, lora_request = self.resolve_model(model)
        if needs_tokenizer is not None:
            self.require_tokenizer(*needs_tokenizer)
        for params, param in grammars:
            await self.check_structured(params, param)
        return model_name, lora_request, await self.bad_words_ids(bad_words)

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

    async def check_structured(self, params: StructuredOutputsParams | None,
                               param: str | None) -> None:
        """Bound a request's grammar in size (the engine's
        ``max_structured_output_spec_bytes``), then parse it without a tokenizer on the
        tokenization worker (never the event loop), before the request is queued; nothing
        for None.

        Raises:
            OpenAIError: 400 naming ``param`` (``response_format``, ``structured_outputs``,
                ``tools``) for a spec over the size bound or an invalid schema, regex or
                grammar.
        """
        if params is None:
            return
        try:
            check_spec_size(params, self.max_spec_bytes)
            await self.prompts.run(check_structured_outputs, params)
        except ValueError as e:
            raise bad_request(str(e), param=param) from None

    async def bad_words_ids(self, words: list[str] | None) -> list[list[int]] | None:
        """A request's ``bad_words`` as ``SamplingParams.bad_words_token_ids`` (each word
        with and without a leading space, vLLM's rule: ``bad_words_token_ids``), bounded
        first (the engine's ``max_bad_words`` and ``max_structured_output_spec_bytes``)
        and tokenized on the tokenization worker, so neither the event loop nor the
        engine's thread pays for them. None for none.

        Raises:
            OpenAIError: 400 (``bad_words``): too many or too large words, no tokenizer,
                or a word that encodes to no token.
        """
        if not words:
            return None
        try:
            check_bad_words(words, self.max_bad_words, self.max_spec_bytes)
        except ValueError as e:
            raise bad_request(str(e), param="bad_words") from None
        tokenizer = self.require_tokenizer("bad_words", param="bad_words")
        try:
            return await self.prompts.run(bad_words_token_ids, tokenizer, words)
        except ValueError as e:
            raise bad_request(str(e), param="bad_words") from None

    def check_text_length(self, text: str, param: str = "prompt") -> None:
        """Refuse a text that is certainly longer than the context, without tokenizing it:
        it has at least ``ceil(len(text) / L)`` tokens (``L``: the most characters a token
        covers, :func:`~manylora.entrypoints.openai.tokenization.max_token_chars`).

        Raises:
            OpenAIError: 413 (``context_length_exceeded``, ``param``) when that bound
                reaches ``max_model_len``.
        """
        at_least = self.prompts.min_tokens(len(text))
        if at_least >= self.max_model_len:
            raise too_large(
                f"This model's maximum context length is {self.max_model_len} tokens, but "
                f"the {param} has at least {at_least} tokens ({len(text)} characters), "
                "leaving no room to generate. Please reduce the length of the "
                f"{param}.", param=param, code="context_length_exceeded")

    def encode_now(self, texts: list[str], add_special_tokens: bool = True,
                   param: str = "prompt", check_length: bool = True) -> list[list[int]]:
        """The token ids of each text, on the calling thread, after the length check of
        each unless ``check_length`` is false (a prompt to be truncated:
        ``truncate_prompt_tokens``) (run it on the tokenization worker: :meth:`tokenize`).

        Raises:
            OpenAIError: 400 without a tokenizer or when the tokenizer fails on a text;
                413 from :meth:`check_text_length`.
        """
        self.require_tokenizer("a text prompt", param=param)
        for text in texts if check_length else ():
            self.check_text_length(text, param)
        try:
            return self.prompts.encode_now(texts, add_special_tokens)
        except Exception as e:
            raise bad_request(f"the {param} could not be tokenized: {e}", param=param) from e

    async def tokenize(self, texts: list[str], add_special_tokens: bool = True,
                       param: str = "prompt", check_length: bool = True) -> list[list[int]]:
        """The token ids of each text, encoded on the tokenization worker thread (the
        event loop stays free), after the length check of each on the loop.

        Raises:
            OpenAIError: as :meth:`encode_now`.
        """
        self.require_tokenizer("a text prompt", param=param)
        for text in texts if check_length else ():
            self.check_text_length(text, param)
        return await self.prompts.run(self.encode_now, texts, add_special_tokens, param,
                                      check_length)

    async def start(self, children: list[ChildRequest],
                    lora_request: LoRARequest | None,
                    client_group: str | None = None) -> MergedStream:
        """Send the children to the engine and wait for each one's first output, so that
        the engine's rejection surfaces here. ``client_group`` (the HTTP request's id) makes
        the children one group for the scheduler's fair sharing of the batch.

        Raises:
            OpenAIError: 400 (``ValueError`` from the engine), 404 (missing adapter files),
                503 (overloaded or stopped engine); every child already added is aborted.
        """
        if self.request_logger is not None:
            for c in children:
                self.request_logger.log_inputs(c.request_id, c.prompt_text,
                                               c.prompt_token_ids, c.params, lora_request)
        gens = [self.engine.generate(c.engine_prompt(), c.params, request_id=c.request_id,
                                     lora_request=lora_request, client_group=client_group)
                for c in children]
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
