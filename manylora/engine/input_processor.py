"""The front's input side (vLLM v1's ``InputProcessor``): a prompt and its
``SamplingParams`` become an ``EngineCoreRequest``, tokenized and checked before anything
reaches the engine core. Bad input raises ``ValueError`` naming the problem."""

from __future__ import annotations

import dataclasses
import operator
from pathlib import Path
from typing import Any

from transformers import GenerationConfig

from manylora.checkpoint.gguf import is_gguf
from manylora.engine.protocol import EngineCoreRequest
from manylora.lora_request import LoRARequest
from manylora.model.loader import load_hf_config
from manylora.sampling_params import SamplingParams
from manylora.structured.bad_words import bad_words_token_ids, check_bad_words
from manylora.structured.grammar import check_spec_size
from manylora.structured_params import StructuredOutputsConfig


def eos_token_ids(model_dir: str | Path, tokenizer: Any, trust_remote_code: bool) -> set[int]:
    """The ids that end generation: the generation config's ``eos_token_id`` (the model
    config's when there is none, or the GGUF file's metadata), and the tokenizer's."""
    ids: set[int] = set()
    try:
        if is_gguf(model_dir):  # a file: no generation_config.json, its metadata's eos
            eos = getattr(load_hf_config(model_dir, trust_remote_code), "eos_token_id", None)
        else:
            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = getattr(load_hf_config(model_dir, trust_remote_code), "eos_token_id", None)
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def cache_salt(prompt: str | dict) -> str | None:
    """A prompt dict's ``cache_salt`` (vLLM's ``TokensPrompt`` key), or None.

    Raises:
        ValueError: a salt that is not a non-empty string.
    """
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r:.40}")
    return salt


class InputProcessor:
    """Tokenizes and checks requests for the engine core.

    Args:
        tokenizer: the ``transformers`` tokenizer, None with ``skip_tokenizer_init``.
        eos_token_ids: the ids that end generation.
        vocab_size: the model's vocabulary size (token ids must lie below it).
        max_bad_words, max_structured_output_spec_bytes: the bounds of one request's
            ``bad_words`` and output constraint (``EngineArgs``').
        structured_outputs_config: the server-wide ``StructuredOutputsConfig``, applied to
            each request's ``structured_outputs``.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], vocab_size: int,
                 max_bad_words: int, max_structured_output_spec_bytes: int,
                 structured_outputs_config: StructuredOutputsConfig) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_bad_words = max_bad_words
        self.max_structured_output_spec_bytes = max_structured_output_spec_bytes
        self.structured_outputs_config = structured_outputs_config

    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """A prompt (text or ``{"prompt_token_ids": [...]}``) → ``(text, token ids)``.

        Raises:
            ValueError: a text prompt without a tokenizer, ids that are not integers or lie
                outside the vocabulary, or a malformed prompt. (The core checks emptiness.)
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer, but the engine was started "
                                 "with skip_tokenizer_init: pass {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            raw = list(prompt["prompt_token_ids"])
            not_ints = [t for t in raw if isinstance(t, bool) or not hasattr(t, "__index__")]
            if not_ints:
                raise ValueError(f"prompt_token_ids must be integers, got {not_ints[:5]}")
            ids = [operator.index(t) for t in raw]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids {bad[:5]} are outside the vocabulary "
                                 f"[0, {self.vocab_size})")
            return prompt.get("prompt"), ids
        raise ValueError("a prompt must be a string or {'prompt_token_ids': [...]}, got "
                         f"{type(prompt).__name__}")

    def process_inputs(self, request_id: str, prompt: str | dict, params: SamplingParams,
                       lora_request: LoRARequest | None, session_id: str | None,
                       arrival: float, client_group: str | None
                       ) -> tuple[str | None, EngineCoreRequest]:
        """Tokenize and check one request: its prompt text (None for token ids) and the
        ``EngineCoreRequest`` for the core, whose params carry the server-wide structured
        output options and ``bad_words`` tokenized into ``bad_words_token_ids``.

        Raises:
            ValueError: a bad prompt or ``cache_salt``, stop strings or ``bad_words``
                without a tokenizer, an output constraint or ``bad_words`` over their
                bounds.
        """
        text, ids = self.tokenize(prompt)
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer, but the engine was started with "
                             "skip_tokenizer_init")
        if params.structured_outputs is not None:
            check_spec_size(params.structured_outputs, self.max_structured_output_spec_bytes)
            structured = self.structured_outputs_config.apply(params.structured_outputs)
            if structured is not params.structured_outputs:
                params = dataclasses.replace(params, structured_outputs=structured)
        if params.bad_words:
            check_bad_words(params.bad_words, self.max_bad_words,
                            self.max_structured_output_spec_bytes)
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer, but the engine was started with "
                                 "skip_tokenizer_init: pass bad_words_token_ids")
            params = dataclasses.replace(
                params, bad_words=None, bad_words_token_ids=(
                    (params.bad_words_token_ids or [])
                    + bad_words_token_ids(self.tokenizer, params.bad_words)))
        return text, EngineCoreRequest(request_id, ids, params, lora_request,
                                       self.eos_token_ids, session_id, arrival, client_group,
                                       cache_salt(prompt))
