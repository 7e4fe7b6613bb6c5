"""Structured output: grammars compiled by xgrammar off the step loop, a matcher per request
in the core, and token bitmasks applied to the logits of the rows that carry one (vLLM v1's
``StructuredOutputManager``)."""

from manylora.structured.grammar import check_structured_outputs, grammar_key
from manylora.structured.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager", "check_structured_outputs", "grammar_key"]
