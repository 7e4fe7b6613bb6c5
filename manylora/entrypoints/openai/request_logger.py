"""``RequestLogger``: vLLM's request log line (``--enable-log-requests``), one INFO line per
engine request on the ``manylora.requests`` logger as it is sent to the engine."""

from __future__ import annotations

import logging

from manylora.lora_request import LoRARequest
from manylora.sampling_params import SamplingParams

logger = logging.getLogger("manylora.requests")


class RequestLogger:
    """Logs ``Received request <id>: prompt: <text>, params: <SamplingParams>,
    prompt_token_ids: <ids>, lora_request: <adapter>.`` (vLLM's ``RequestLogger.log_inputs``).

    Args:
        max_log_len: the most characters of the prompt text and the most prompt token ids
            shown (vLLM's ``--max-log-len``); None: all.
    """

    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def log_inputs(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                   params: SamplingParams, lora_request: LoRARequest | None) -> None:
        """Log one engine request's inputs (the adapter by name and id, never its path)."""
        if self.max_log_len is not None:
            prompt = None if prompt is None else prompt[:self.max_log_len]
            prompt_token_ids = prompt_token_ids[:self.max_log_len]
        adapter = (None if lora_request is None else
                   f"{lora_request.lora_name} (id {lora_request.lora_int_id})")
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, "
                    "lora_request: %s.", request_id, prompt, params, prompt_token_ids,
                    adapter)
