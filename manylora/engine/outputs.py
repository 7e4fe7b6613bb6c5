"""What ``LLM.generate`` and ``LLMEngine.step`` return (vLLM's ``RequestOutput`` shape)."""

from __future__ import annotations

from dataclasses import dataclass

from manylora.lora_request import LoRARequest


@dataclass
class Logprob:
    """The log-probability of one token at one generated position (vLLM's ``Logprob``).

    Attributes:
        logprob: natural log of the token's probability under the raw model distribution,
            ``log_softmax(logits)`` in float32, before temperature, top-k, top-p and min-p
            (vLLM v1's default ``logprobs_mode="raw_logprobs"``); ``<= 0``.
        rank: 1 + the number of vocabulary tokens with a strictly larger log-probability at
            that position (1 = most likely).
        decoded_token: the token alone as text (``convert_ids_to_tokens`` then
            ``convert_tokens_to_string`` of that single id; ``""`` for an id the tokenizer
            does not know), None when the engine has no tokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        text: the detokenized output so far (stop string removed unless asked to keep it).
        token_ids: every generated token id.
        finish_reason: None while running, else ``"stop"`` (EOS, stop string or stop token),
            ``"length"`` (max_tokens or the context), ``"abort"`` or ``"error"`` (the engine
            could not serve it: ``RequestOutput.error``).
        stop_reason: the stop string or token id that ended it, None for EOS or length.
        cumulative_logprob: the sum of the sampled tokens' ``Logprob.logprob`` (natural
            log of the sequence's probability under the raw model distribution), None
            unless ``SamplingParams.logprobs`` was set.
        logprobs: one dict per generated token, in order, mapping token id to
            :class:`Logprob`: the sampled token first, then the ``SamplingParams.logprobs``
            most likely tokens (so N + 1 entries, or N when the sampled token is among
            them); None unless ``SamplingParams.logprobs`` was set. As vLLM's
            ``SampleLogprobs``.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: LoRARequest | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step (or at the end of ``generate``).

    Attributes:
        error: why the engine could not serve the request, when it ended with
            ``finish_reason`` ``"error"`` (an adapter whose read failed:
            ``LoRAAdapterError`` naming the adapter and the problem, ``FileNotFoundError``,
            ...); None otherwise. ``LLM`` reports it per request; ``AsyncLLM.generate``
            raises it.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs`` N, one entry per prompt
            token (vLLM's ``PromptLogprobs``): None for the first, then
            ``{token_id: Logprob}`` with the prompt token first (its log-probability given
            the tokens before it, under the request's adapter, and its rank), then the N
            most likely tokens at that position; None unless asked. A ``DELTA`` request
            gets them in its first output only.
        num_cached_tokens: the prompt tokens served from the prefix cache (vLLM's), known
            from the first output token on; None before.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    lora_request: LoRARequest | None = None
    error: Exception | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None
