"""Tool call parsers (vLLM's ``--tool-call-parser NAME``): each reads one model family's
tool call format out of generated text, whole (``extract_tool_calls``) or streamed
(``streaming()``). ``base.py`` holds the scanner they share; one module per format."""

from __future__ import annotations

from manylora.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    StreamingToolExtractor,
    ToolDelta,
    ToolParser,
)
from manylora.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from manylora.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from manylora.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from manylora.entrypoints.openai.tool_parsers.required import RequiredToolCallsParser

__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "RequiredToolCallsParser",
    "StreamingToolExtractor",
    "ToolDelta",
    "ToolParser",
    "get_tool_parser",
]

#: The formats ``--tool-call-parser`` takes, by vLLM's names.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser ``--tool-call-parser name`` selects.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None
