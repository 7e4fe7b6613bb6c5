"""The sampling fields of a completions or chat request, resolved into ``SamplingParams``
keyword arguments with vLLM's precedence: what the request sets, else the server's default
(the checkpoint's ``generation_config.json`` under ``--generation-config auto``,
:mod:`~manylora.entrypoints.openai.generation_config`), else OpenAI's default.

Follows vLLM's ``CompletionRequest.to_sampling_params`` / ``ChatCompletionRequest
.to_sampling_params`` (``_DEFAULT_SAMPLING_PARAMS``). The penalties, ``logit_bias`` and
``allowed_token_ids`` go to the engine as they are (``manylora/sample/penalties.py`` applies
them); their ranges are checked by ``SamplingParams`` and the vocabulary bound by the engine
core, both with a message naming the field (a 400 with that ``param``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["OPENAI_DEFAULTS", "cap_max_tokens", "resolve_sampling"]

#: OpenAI's (and vLLM's) defaults of the fields a server default may replace.
OPENAI_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
}


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
