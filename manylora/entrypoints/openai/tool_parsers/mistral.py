"""Mistral's tool call format (``--tool-call-parser mistral``): ``[TOOL_CALLS]`` then a
JSON array of ``{"name": ..., "arguments": {...}}`` (tokenizers before v11), or
``[TOOL_CALLS]name{...}`` / ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11 and later), after
optional content (vLLM's ``MistralToolParser``). Ids are nine letters and digits, the form
Mistral's chat templates require."""

from __future__ import annotations

import random
import re
import string

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

__all__ = ["MistralToolParser"]

START, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS]`` followed by a JSON array of calls or by ``name[ARGS]{...}``. The
    marker is a control token the detokenizer keeps (``skip_special_tokens`` False)."""

    name = "mistral"
    start_chars = "["
    skip_special_tokens = False

    def may_start(self, text: str, pos: int, boundary: bool) -> bool | None:
        """True at ``[TOOL_CALLS]``, None at a prefix of it that ends the text."""
        return marker_start(text, pos, START)

    def make_id(self) -> str:
        """Nine random letters and digits (Mistral's tool call id form)."""
        return "".join(random.choices(_ID_CHARS, k=9))

    def match(self, text: str, pos: int, final: bool, memo: dict):
        """Read ``[TOOL_CALLS]`` and its array or ``name[ARGS]{...}`` at ``pos``."""
        start = skip_whitespace(text, pos + len(START))
        if start == len(text):
            return pos + 1 if final else PENDING
        if text[start] == "[":
            end = json_value_end(text, start, memo)
            if end is None:
                return pos + 1 if final else PENDING
            items = parse_json(text[start:end])
            calls = [call_from_object(c) for c in items] if isinstance(items, list) else []
            if not calls or None in calls:
                return pos + 1
            return CallMatch(end, calls)
        name = _NAME.match(text, start)
        if name is None:
            return pos + 1
        brace = name.end()
        rest = text[brace:brace + len(ARGS)]
        if rest == ARGS:
            brace += len(ARGS)
        elif rest and ARGS.startswith(rest) and brace + len(rest) == len(text):
            return pos + 1 if final else PENDING
        if brace == len(text):
            return pos + 1 if final else PENDING
        if text[brace] != "{":
            return pos + 1
        end = json_value_end(text, brace, memo)
        if end is None:
            return pos + 1 if final else PENDING
        arguments = parse_json(text[brace:end])
        call = call_from_object({"name": name.group(), "arguments": arguments})
        return pos + 1 if call is None else CallMatch(end, [call])
