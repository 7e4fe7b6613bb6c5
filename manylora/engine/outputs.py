"""What ``LLM.generate`` and ``LLMEngine.step`` return (vLLM's ``RequestOutput`` shape)."""

from __future__ import annotations

from dataclasses import dataclass

from manylora.lora.request import LoRARequest


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        text: the detokenized output so far (stop string removed unless asked to keep it).
        token_ids: every generated token id.
        finish_reason: None while running, else ``"stop"`` (EOS, stop string or stop token),
            ``"length"`` (max_tokens or the context) or ``"abort"``.
        stop_reason: the stop string or token id that ended it, None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: LoRARequest | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step (or at the end of ``generate``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    lora_request: LoRARequest | None = None
