"""Hermes' tool call format (``--tool-call-parser hermes``; Hermes 2 Pro / 3, Qwen 2.5 and
3): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, after
optional content (vLLM's ``Hermes2ProToolParser``)."""

from __future__ import annotations

from manylora.entrypoints.openai.tool_parsers.base import (
    PENDING,
    CallMatch,
    ToolParser,
    call_from_object,
    json_value_end,
    marker_start,
    parse_json,
    skip_whitespace,
)

__all__ = ["HermesToolParser"]

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    """``<tool_call>`` JSON ``</tool_call>``, repeated for parallel calls. A call whose
    closing tag is missing at the very end of the output (the model stopped right after
    the JSON) still counts, as vLLM's pattern accepts it. The tags may be special tokens:
    the detokenizer keeps them (``skip_special_tokens`` False)."""

    name = "hermes"
    start_chars = "<"
    skip_special_tokens = False

    def may_start(self, text: str, pos: int, boundary: bool) -> bool | None:
        """True at ``<tool_call>``, None at a prefix of it that ends the text."""
        return marker_start(text, pos, START)

    def match(self, text: str, pos: int, final: bool, memo: dict):
        """Read ``<tool_call>`` JSON ``</tool_call>`` at ``pos`` (see ``ToolParser``)."""
        start = skip_whitespace(text, pos + len(START))
        if start == len(text):
            return pos + 1 if final else PENDING
        if text[start] != "{":
            return pos + 1
        end = json_value_end(text, start, memo)
        if end is None:
            return pos + 1 if final else PENDING
        call = call_from_object(parse_json(text[start:end]))
        if call is None:
            return pos + 1
        close = skip_whitespace(text, end)
        rest = text[close:close + len(END)]
        if rest == END:
            return CallMatch(close + len(END), [call])
        if close == len(text) or END.startswith(rest):
            if not final:
                return PENDING
            return CallMatch(close, [call]) if close == len(text) else pos + 1
        return pos + 1
