"""Offline test fixtures: tiny checkpoints, tokenizers, peft adapters and HF references."""

from __future__ import annotations

from manylora.testing.adapters import make_peft_adapter
from manylora.testing.checkpoint import SUPPORTED_ARCHS, make_checkpoint
from manylora.testing.demo_set import DEMO_ADAPTER_SPECS, DemoSet, make_demo_set
from manylora.testing.families import (
    FAMILY_ADAPTER_NAMES,
    FAMILY_SPECS,
    FAMILY_TEXTS,
    MOE_FAMILIES,
    MOE_TINY,
    FamilyCase,
    assert_greedy_matches,
    generate_greedy,
    generate_twice_from_prefix_cache,
    lora_requests,
    make_family_case,
    shutting_down,
)
from manylora.testing.reference import (
    ReferenceOutput,
    agreement,
    compare_greedy,
    hf_greedy_reference,
)
from manylora.testing.tokenizer import CHAT_TEMPLATE, make_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "DEMO_ADAPTER_SPECS",
    "FAMILY_ADAPTER_NAMES",
    "FAMILY_SPECS",
    "FAMILY_TEXTS",
    "MOE_FAMILIES",
    "MOE_TINY",
    "SUPPORTED_ARCHS",
    "DemoSet",
    "FamilyCase",
    "ReferenceOutput",
    "agreement",
    "assert_greedy_matches",
    "compare_greedy",
    "generate_greedy",
    "generate_twice_from_prefix_cache",
    "hf_greedy_reference",
    "lora_requests",
    "make_checkpoint",
    "make_demo_set",
    "make_family_case",
    "make_peft_adapter",
    "make_tokenizer",
    "shutting_down",
]
