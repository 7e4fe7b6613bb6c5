"""A request's ``SamplingParams``: the sampling fields of a completions or chat request
resolved with vLLM's precedence (what the request sets, else the server's default: the
checkpoint's ``generation_config.json`` under ``--generation-config auto``,
:mod:`~manylora.entrypoints.openai.generation_config`; else OpenAI's default), ``max_tokens``
fitted to the context, the engine's output kind (``DELTA`` when streamed: only what is new,
with no part of a stop string ever in them; ``FINAL_ONLY`` otherwise), and the ``n``
children's seeds (vLLM's parallel sampling). ``SamplingParams``' own errors become 400s
naming the field.

Follows vLLM's ``CompletionRequest.to_sampling_params`` / ``ChatCompletionRequest
.to_sampling_params`` (``_DEFAULT_SAMPLING_PARAMS``). The penalties, ``logit_bias`` and
``allowed_token_ids`` go to the engine as they are (``manylora/sample/penalties.py`` applies
them); their ranges are checked by ``SamplingParams`` and the vocabulary bound by the engine
core, both with a message naming the field (a 400 with that ``param``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from manylora.entrypoints.openai.errors import bad_request, too_large
from manylora.sampling_params import RequestOutputKind, SamplingParams
from manylora.structured_params import StructuredOutputsParams

__all__ = ["OPENAI_DEFAULTS", "cap_max_tokens", "check_context_length",
           "child_sampling_params", "make_sampling_params", "output_kind",
           "request_sampling_params", "resolve_sampling"]

#: OpenAI's (and vLLM's) defaults of the fields a server default may replace.
OPENAI_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
}

# The fields a SamplingParams error may name (its message starts with the field).
_SAMPLING_FIELDS = frozenset({
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
    "stop_token_ids", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
    "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words"})


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
        first = message.split(" ", 1)[0].split("[", 1)[0]
        raise bad_request(message, param=first if first in _SAMPLING_FIELDS else None) from None


def output_kind(stream: bool) -> RequestOutputKind:
    """What the engine reports for a request: ``DELTA`` when streamed (each chunk is the
    new part), else ``FINAL_ONLY`` (the response is built from the last output)."""
    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


def child_sampling_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The ``n`` children's parameters for one prompt: the same, but child ``i`` seeded
    with ``seed + i`` when a seed is set (vLLM's parallel sampling), wrapped into the
    signed 64-bit range as a 64-bit addition wraps (any seed of that range takes any
    ``n``)."""
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=(params.seed + i + 2**63) % 2**64 - 2**63)
            for i in range(n)]


def resolve_sampling(request: Any, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``SamplingParams`` keyword arguments of ``request``'s sampling fields.

    Args:
        request: a ``CompletionRequest`` or ``ChatCompletionRequest``; a field left unset
            (None) takes the server's default, else OpenAI's (:data:`OPENAI_DEFAULTS`).
        defaults: the server's defaults (``temperature``, ``top_p``, ``top_k``, ``min_p``,
            ``repetition_penalty``, ...), e.g. from the checkpoint's generation config.

    Returns:
        ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
        ``presence_penalty``, ``frequency_penalty`` (floats / ints), ``logit_bias``
        (``{"id": bias}`` as sent: ``SamplingParams`` turns the keys into ints and names a
        bad one) and ``allowed_token_ids``.
    """
    defaults = defaults or {}
    out: dict[str, Any] = {}
    for name, default in OPENAI_DEFAULTS.items():
        value = getattr(request, name, None)
        out[name] = value if value is not None else defaults.get(name, default)
    out["logit_bias"] = request.logit_bias or None
    out["allowed_token_ids"] = getattr(request, "allowed_token_ids", None)
    return out


def cap_max_tokens(max_tokens: int, defaults: Mapping[str, Any] | None) -> int:
    """``max_tokens`` capped by the server's default ``max_tokens`` (the generation
    config's ``max_new_tokens``), as vLLM's ``get_max_tokens``: the least of what the
    request asks (or the room left in the context) and that default."""
    cap = (defaults or {}).get("max_tokens")
    return max_tokens if cap is None else min(max_tokens, int(cap))


def request_sampling_params(request: Any, defaults: Mapping[str, Any] | None, *,
                            num_prompt_tokens: int, max_model_len: int,
                            max_tokens: int | None, logprobs: int | None,
                            prompt_logprobs: int | None,
                            structured: StructuredOutputsParams | None,
                            bad_words: list[list[int]] | None,
                            prompt_param: str = "prompt",
                            max_tokens_param: str = "max_tokens") -> SamplingParams:
    """The ``SamplingParams`` of one prompt of a completions or chat request (before the
    ``n`` children's seeds: :func:`child_sampling_params`).

    Args:
        request: a ``CompletionRequest`` or ``ChatCompletionRequest`` (its sampling,
            stop, special-token and ``stream`` fields).
        defaults: the server's ``--generation-config`` defaults (:func:`resolve_sampling`;
            ``max_tokens`` caps the request's: :func:`cap_max_tokens`).
        num_prompt_tokens: the prompt's length in tokens.
        max_model_len: the context length in tokens.
        max_tokens: the most tokens the request asks the engine for; None: to the end of
            the context.
        logprobs, prompt_logprobs: the engine's log-probabilities per generated and per
            prompt token (None: none).
        structured: the output constraint, or None.
        bad_words: ``bad_words_token_ids``, or None.
        prompt_param, max_tokens_param: the parameter names context errors report.

    Raises:
        OpenAIError: :func:`check_context_length`'s 400 and 413, then
            :func:`make_sampling_params`' 400.
    """
    fitted = cap_max_tokens(check_context_length(
        num_prompt_tokens, max_tokens, max_model_len, prompt_param=prompt_param,
        max_tokens_param=max_tokens_param), defaults)
    return make_sampling_params(
        **resolve_sampling(request, defaults), seed=request.seed, max_tokens=fitted,
        min_tokens=request.min_tokens or 0, stop=request.stop,
        stop_token_ids=request.stop_token_ids, ignore_eos=bool(request.ignore_eos),
        skip_special_tokens=(True if request.skip_special_tokens is None
                             else request.skip_special_tokens),
        include_stop_str_in_output=bool(request.include_stop_str_in_output),
        spaces_between_special_tokens=request.spaces_between_special_tokens is not False,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured_outputs=structured,
        bad_words_token_ids=bad_words, output_kind=output_kind(bool(request.stream)))
