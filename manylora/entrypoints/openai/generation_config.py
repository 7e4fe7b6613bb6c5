"""The server's default sampling parameters from a checkpoint's ``generation_config.json``
(vLLM's ``--generation-config`` and ``--override-generation-config``).

Follows vLLM's ``ModelConfig.get_diff_sampling_param``: ``"auto"`` reads the model folder's
generation config, a folder path reads that folder's, ``"vllm"`` reads none; of what differs
from Hugging Face's defaults (``GenerationConfig.to_diff_dict``), ``repetition_penalty``,
``temperature``, ``top_k``, ``top_p`` and ``min_p`` become the defaults of requests that do
not set them, and ``max_new_tokens`` becomes ``max_tokens``, a cap on every request's
completion length. ``--override-generation-config`` (JSON) is applied on top.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from transformers import GenerationConfig

from manylora.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["SAMPLING_KEYS", "generation_defaults", "parse_override"]

#: The generation-config keys that become server defaults (vLLM's ``available_params``).
SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p",
                 "max_new_tokens")


def parse_override(text: str | None) -> dict[str, Any]:
    """``--override-generation-config``'s JSON object, or ``{}`` for None.

    Raises:
        ValueError: the text is not a JSON object.
    """
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--override-generation-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--override-generation-config must be a JSON object, got "
                         f"{type(value).__name__}")
    return value


def _read(folder: str) -> dict[str, Any]:
    """The non-default entries of ``folder``'s ``generation_config.json``; ``{}`` when it
    has none."""
    if not (Path(folder) / "generation_config.json").is_file():
        return {}
    return GenerationConfig.from_pretrained(folder).to_diff_dict()


def generation_defaults(source: str, model_path: str,
                        override: dict[str, Any] | None = None) -> dict[str, Any]:
    """The server's default sampling parameters.

    Args:
        source: ``"auto"`` (the model folder's ``generation_config.json``), ``"vllm"``
            (none: OpenAI's defaults), or a folder holding a ``generation_config.json``.
        model_path: the model's local folder.
        override: entries replacing the file's (``--override-generation-config``).

    Returns:
        Of ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
        ``max_tokens`` (from ``max_new_tokens``), those the config sets (not None).

    Raises:
        ValueError: ``source`` is neither keyword nor a folder, its file cannot be read, or
            its defaults are not valid sampling parameters (``SamplingParams``' message).
    """
    if source not in ("auto", "vllm") and not Path(source).is_dir():
        raise ValueError(f"--generation-config {source!r}: expected 'auto', 'vllm' or a "
                         "folder holding generation_config.json")
    try:
        config = {} if source == "vllm" else _read(model_path if source == "auto" else source)
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config {source!r}: {e}") from None
    config.update(override or {})
    defaults = {k: config[k] for k in SAMPLING_KEYS if config.get(k) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    try:                                 # a bad default would fail every request: fail now
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        where = (" with --override-generation-config" if override else "")
        raise ValueError(f"--generation-config {source!r}{where}: its sampling defaults are "
                         f"not valid: {e}") from None
    if defaults:
        logger.info("Default sampling parameters from the generation config (requests that "
                    "set them override them): %s", defaults)
    return defaults
