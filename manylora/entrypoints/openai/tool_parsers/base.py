"""The base of the tool call parsers: one scanner, run incrementally, behind both the
non-streamed :meth:`ToolParser.extract_tool_calls` and the streamed
:class:`StreamingToolExtractor` (vLLM's ``ToolParser`` interface: ``extract_tool_calls`` and
``extract_tool_calls_streaming``).

A format (one subclass each) says where a call may start (:meth:`ToolParser.may_start`) and
reads one call region from there (:meth:`ToolParser.match`): the calls it holds, "not a
call" (that text is content), or "undecided until more text comes". The scanner walks the
model's text once: text that cannot start a call is content at once; a region that may be a
call is held back until it is decided. Every decision depends only on the text before the
point decided, so the streamed pieces, concatenated, are the non-streamed result for every
way the text can be split into deltas.

Semantics (what a client gets):

* a call is reported once its region is complete and its JSON valid: its first piece has
  ``index``, ``id``, ``type`` and the ``name`` (``arguments: ""``), the next its
  ``arguments`` (``json.dumps`` of the parsed arguments, ``ensure_ascii=False``, as vLLM
  writes them). Arguments are therefore always one valid JSON document;
* a malformed region (bad JSON, no ``name``, arguments that are not an object, a region cut
  off by the end of the output) is content, kept verbatim: nothing the model wrote is lost;
* whitespace between calls and after the last one is dropped, and so is whitespace-only
  content before the first call; content is None when only calls were written.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from manylora.entrypoints.openai.protocol_tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)

__all__ = [
    "PENDING",
    "WHITESPACE",
    "CallMatch",
    "ExtractedToolCalls",
    "StreamingToolExtractor",
    "ToolDelta",
    "ToolParser",
    "call_from_object",
    "json_value_end",
    "marker_start",
    "skip_whitespace",
]


class _Pending:
    def __repr__(self) -> str:
        return "PENDING"


#: :meth:`ToolParser.match`'s answer when more text is needed to decide.
PENDING = _Pending()


@dataclass(frozen=True)
class CallMatch:
    """A call region read whole: it ends at ``end`` (exclusive) and holds ``calls``
    (``(name, arguments JSON text)`` pairs, in order)."""

    end: int
    calls: list[tuple[str, str]]


@dataclass
class ExtractedToolCalls:
    """The result of parsing a whole output (vLLM's ``ExtractedToolCallInformation``):
    ``tool_calls`` found (in order) and the ``content`` around them (None when there is
    none)."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        """Whether any call was found."""
        return bool(self.tool_calls)


@dataclass
class ToolDelta:
    """What one step of the streamed extraction adds: content text and/or tool call
    pieces (the fields of a ``DeltaMessage``)."""

    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


def json_value_end(text: str, start: int, memo: dict[int, tuple[int, int, bool, bool]]
                   ) -> int | None:
    """The end (exclusive) of the JSON object or array opening at ``text[start]`` by
    bracket depth outside strings, or None when ``text`` ends first. Resumes from the
    state ``memo[start]`` left (the text only grows), so a region streamed token by token
    is scanned once: O(new characters) per call.

    Args:
        text: the text so far.
        start: the index of ``{`` or ``[``.
        memo: per start index, ``(scanned up to, depth, in string, after backslash)``.
    """
    pos, depth, in_str, escaped = memo.get(start, (start, 0, False, False))
    n = len(text)
    while pos < n:
        ch = text[pos]
        pos += 1
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                memo.pop(start, None)
                return pos
    memo[start] = (pos, depth, in_str, escaped)
    return None


def call_from_object(obj: Any, names: tuple[str, ...] = ("arguments", "parameters")
                     ) -> tuple[str, str] | None:
    """``(name, arguments JSON text)`` of a parsed call object ``{"name": str, <one of
    names>: object}``, or None when ``obj`` is not one (no string name, both or neither
    arguments key, arguments not an object)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    present = [k for k in names if k in obj]
    if len(present) != 1 or not isinstance(obj[present[0]], dict):
        return None
    return obj["name"], json.dumps(obj[present[0]], ensure_ascii=False)


def parse_json(text: str) -> Any:
    """``json.loads(text)``, or a sentinel (never equal to a JSON value) when it fails."""
    try:
        return json.loads(text)
    except ValueError:
        return _INVALID


_INVALID = object()
# JSON whitespace: what may stand between calls and inside a call region
WHITESPACE = " \t\r\n"


def skip_whitespace(text: str, pos: int) -> int:
    """The index of the first character at or after ``pos`` that is not JSON whitespace
    (``len(text)`` when none is)."""
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def marker_start(text: str, pos: int, marker: str) -> bool | None:
    """:meth:`ToolParser.may_start` for a literal start marker: True when ``marker`` begins
    at ``pos``, None when the text ends inside a prefix of it, else False."""
    rest = text[pos:pos + len(marker)]
    if rest == marker:
        return True
    return None if marker.startswith(rest) else False


class ToolParser(ABC):
    """A tool call format (vLLM's ``--tool-call-parser NAME``). Subclasses set ``name``,
    ``start_chars`` and implement :meth:`may_start` and :meth:`match`.

    Class attributes:
        name: the ``--tool-call-parser`` value.
        start_chars: every character a call region can begin with (content without them
            is passed on at once).
        between_calls: characters dropped after a call (whitespace; ``;`` for Llama 3).
        skip_special_tokens: False when the format's markers are special tokens the
            detokenizer must keep (vLLM's ``adjust_request``).
    """

    name: ClassVar[str] = ""
    start_chars: ClassVar[str] = ""
    between_calls: ClassVar[str] = WHITESPACE
    skip_special_tokens: ClassVar[bool] = True

    def __init__(self) -> None:
        self._start_re = re.compile("[" + re.escape(self.start_chars) + "]")

    @abstractmethod
    def may_start(self, text: str, pos: int, boundary: bool) -> bool | None:
        """Whether a call region may begin at ``text[pos]`` (a ``start_chars``
        character): True, False, or None when the text ends inside what could still
        become a start marker.

        Args:
            boundary: only whitespace (or calls) precede ``pos`` in the output.
        """

    @abstractmethod
    def match(self, text: str, pos: int, final: bool,
              memo: dict) -> CallMatch | int | _Pending:
        """Read the call region beginning at ``pos``.

        Args:
            final: the text is the whole output (nothing undecided may remain).
            memo: the scanner's memo for :func:`json_value_end`.

        Returns:
            a :class:`CallMatch`; an ``int``: not a call, the text up to that index is
            content; or :data:`PENDING` (only when not ``final``).
        """

    def make_id(self) -> str:
        """A fresh tool call id (vLLM's ``chatcmpl-tool-...``)."""
        return make_tool_call_id()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The tool calls and content of a whole output (see the module docstring)."""
        stream = StreamingToolExtractor(self)
        deltas = stream.feed(text) + stream.finish()
        content = "".join(d.content for d in deltas if d.content) or None
        calls: dict[int, ToolCall] = {}
        for delta in deltas:
            for piece in delta.tool_calls:
                if piece.index not in calls:
                    calls[piece.index] = ToolCall(id=piece.id, function=FunctionCall(
                        name=piece.function.name, arguments=""))
                calls[piece.index].function.arguments += piece.function.arguments or ""
        return ExtractedToolCalls(content=content, tool_calls=list(calls.values()))

    def streaming(self) -> StreamingToolExtractor:
        """A streamed extraction for one choice."""
        return StreamingToolExtractor(self)


class StreamingToolExtractor:
    """The incremental extraction of one choice's tool calls (vLLM's
    ``extract_tool_calls_streaming``): :meth:`feed` each new piece of text, then
    :meth:`finish` once; each returns the :class:`ToolDelta` s to send.

    Args:
        parser: the format.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.pos = 0                 # text before pos is decided (sent or dropped)
        self.num_calls = 0
        self._memo: dict = {}
        self._after_call = False     # the characters since the last call were dropped
        self._started = False        # content other than whitespace was sent
        self._held = ""              # whitespace-only content not sent yet

    @property
    def tools_called(self) -> bool:
        """Whether a call has been reported."""
        return self.num_calls > 0

    def feed(self, delta_text: str) -> list[ToolDelta]:
        """The deltas ``delta_text`` decides (text held back may be decided later)."""
        self.text += delta_text
        return self._scan(final=False)

    def finish(self) -> list[ToolDelta]:
        """The deltas of everything still undecided, the output being complete."""
        out = self._scan(final=True)
        if self._held and not self.num_calls:
            out.append(ToolDelta(content=self._held))
        self._held = ""
        return out

    def _content(self, piece: str, out: list[ToolDelta]) -> None:
        if not piece:
            return
        if not self._started:
            if not piece.strip(WHITESPACE):
                self._held += piece
                return
            piece, self._held, self._started = self._held + piece, "", True
        if out and out[-1].content is not None and not out[-1].tool_calls:
            out[-1].content += piece
        else:
            out.append(ToolDelta(content=piece))

    def _call(self, name: str, arguments: str, out: list[ToolDelta]) -> None:
        index = self.num_calls
        self.num_calls += 1
        out.append(ToolDelta(tool_calls=[DeltaToolCall(
            index=index, id=self.parser.make_id(), type="function",
            function=DeltaFunctionCall(name=name, arguments=""))]))
        out.append(ToolDelta(tool_calls=[DeltaToolCall(
            index=index, function=DeltaFunctionCall(arguments=arguments))]))

    def _scan(self, final: bool) -> list[ToolDelta]:
        parser, text, out = self.parser, self.text, []
        i, n = self.pos, len(self.text)
        while i < n:
            if self._after_call:
                while i < n and text[i] in parser.between_calls:
                    i += 1
                if i == n:
                    break
            found = parser._start_re.search(text, i)
            j = found.start() if found else n
            if j > i:
                self._content(text[i:j], out)
                self._after_call = False
                i = j
                if i == n:
                    break
            boundary = self._after_call or not self._started
            start = parser.may_start(text, i, boundary)
            if start is None and not final:
                break
            if start:
                result = parser.match(text, i, final, self._memo)
                if result is PENDING:
                    if not final:
                        break
                    result = i + 1       # a format's bug: never leave text undecided
                if isinstance(result, CallMatch):
                    for name, arguments in result.calls:
                        self._call(name, arguments, out)
                    self._held = ""
                    self._after_call = True
                    i = result.end
                    continue
                end = max(int(result), i + 1)
            else:
                end = i + 1
            self._content(text[i:end], out)
            self._after_call = False
            i = end
        self.pos = i
        return out
