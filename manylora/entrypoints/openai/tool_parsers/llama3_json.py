"""Llama 3.1 / 3.2 / 3.3's JSON tool call format (``--tool-call-parser llama3_json``): the
output is one or more ``{"name": ..., "parameters": {...}}`` objects (or ``"arguments"``),
separated by ``;``, optionally after ``<|python_tag|>`` (vLLM's ``Llama3JsonToolParser``)."""

from __future__ import annotations

from manylora.entrypoints.openai.tool_parsers.base import (
    PENDING,
    WHITESPACE,
    CallMatch,
    ToolParser,
    call_from_object,
    json_value_end,
    marker_start,
    parse_json,
    skip_whitespace,
)

__all__ = ["Llama3JsonToolParser"]

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """Calls begin the output (after whitespace), follow another call (after ``;``), or
    follow ``<|python_tag|>`` anywhere (content before it is the message's content). A
    ``{`` inside content is content: JSON a model quotes in its answer is not a call."""

    name = "llama3_json"
    start_chars = "{<"
    between_calls = WHITESPACE + ";"

    def may_start(self, text: str, pos: int, boundary: bool) -> bool | None:
        """True at ``{`` on a boundary and at ``<|python_tag|>``; None at a prefix of the
        tag that ends the text."""
        if text[pos] == "{":
            return boundary
        return marker_start(text, pos, PYTHON_TAG)

    def match(self, text: str, pos: int, final: bool, memo: dict):
        """Read ``[<|python_tag|>] {call}`` at ``pos`` (see ``ToolParser``)."""
        start = pos
        if text[pos] == "<":
            start = skip_whitespace(text, pos + len(PYTHON_TAG))
            if start == len(text):
                return pos + 1 if final else PENDING
            if text[start] != "{":
                return pos + 1
        end = json_value_end(text, start, memo)
        if end is None:
            return pos + 1 if final else PENDING
        call = call_from_object(parse_json(text[start:end]))
        if call is None:         # JSON that is not a call: all of it is content
            return end if start == pos else pos + 1
        return CallMatch(end, [call])
