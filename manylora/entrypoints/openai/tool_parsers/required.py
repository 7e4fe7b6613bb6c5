"""The output of ``tool_choice: "required"``: the grammar makes the model write vLLM's
array ``[{"name": ..., "parameters": {...}}, ...]``; this reads it as calls, streamed and
not, with the scanner every format uses (so a call is reported when its object is
complete)."""

from __future__ import annotations

from manylora.entrypoints.openai.tool_parsers.base import (
    PENDING,
    WHITESPACE,
    CallMatch,
    ToolParser,
    call_from_object,
    json_value_end,
    parse_json,
    skip_whitespace,
)

__all__ = ["RequiredToolCallsParser"]



class RequiredToolCallsParser(ToolParser):
    """Each ``{...}`` of the array is one call; the brackets, commas and whitespace around
    them are dropped (also in an output cut off by ``max_tokens``, whose unfinished object
    is content). Not a ``--tool-call-parser`` (no name): it reads the output the
    required choice's schema (``protocol_tools.required_tools_schema``) allows."""

    start_chars = "[{"
    between_calls = WHITESPACE + ",]"

    def may_start(self, text: str, pos: int, boundary: bool) -> bool | None:
        """True at the array's ``[`` and at an object on a boundary."""
        return boundary

    def match(self, text: str, pos: int, final: bool, memo: dict):
        """The opening ``[`` is a region with no call; each object one call."""
        if text[pos] == "[":
            start = skip_whitespace(text, pos + 1)
            if start == len(text):
                return pos + 1 if final else PENDING
            return CallMatch(start, []) if text[start] == "{" else pos + 1
        end = json_value_end(text, pos, memo)
        if end is None:
            return pos + 1 if final else PENDING
        call = call_from_object(parse_json(text[pos:end]), names=("parameters",))
        return pos + 1 if call is None else CallMatch(end, [call])
