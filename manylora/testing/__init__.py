"""Offline test fixtures: tiny checkpoints, tokenizers, peft adapters and HF references."""

from __future__ import annotations

from manylora.testing.factories import (
    CHAT_TEMPLATE,
    DEMO_ADAPTER_SPECS,
    SUPPORTED_ARCHS,
    DemoSet,
    make_checkpoint,
    make_demo_set,
    make_peft_adapter,
    make_tokenizer,
)
from manylora.testing.reference import (
    ReferenceOutput,
    agreement,
    compare_greedy,
    hf_greedy_reference,
)

__all__ = [
    "CHAT_TEMPLATE",
    "DEMO_ADAPTER_SPECS",
    "SUPPORTED_ARCHS",
    "DemoSet",
    "ReferenceOutput",
    "agreement",
    "compare_greedy",
    "hf_greedy_reference",
    "make_checkpoint",
    "make_demo_set",
    "make_peft_adapter",
    "make_tokenizer",
]
