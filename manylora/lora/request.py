"""``LoRARequest``: which adapter a request runs with (vLLM's type and field names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Names an adapter for a request.

    Attributes:
        lora_name: a human-readable name (reported in outputs and metrics).
        lora_int_id: a unique positive integer; the identity of the adapter in the host tier,
            the device slots and the scheduler (TensorRT-LLM calls it task_id). Two requests
            with the same id share one loaded copy.
        lora_path: a local directory or a Hugging Face hub repo id of a PEFT adapter.
        base_model_name: optional; only reported.

    Raises:
        ValueError: ``lora_int_id`` < 1 or an empty ``lora_path``.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer ≥ 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r} has no lora_path")
