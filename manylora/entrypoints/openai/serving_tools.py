"""What a chat request's ``tools`` and ``tool_choice`` do to its engine requests and to
its response (vLLM's tool calling in ``serving_chat``).

:meth:`ToolPlan.for_request` decides one of four modes:

* ``none``: no tools, or ``tool_choice: "none"``: the output is text (tools given are still
  rendered into the prompt, as vLLM does by default);
* ``auto``: tools and ``tool_choice`` ``"auto"`` or unset: the server's
  ``--tool-call-parser`` reads calls out of the text, streamed and not; without
  ``--enable-auto-tool-choice`` and a parser this is a 400, as in vLLM;
* ``required``: the grammar engine constrains the output to vLLM's array of
  ``{"name", "parameters"}`` objects (``protocol_tools.required_tools_schema``; one call at
  most when ``parallel_tool_calls`` is false), read back as calls;
* ``named``: the output is constrained to the named tool's parameters schema and is that
  call's arguments, streamed as they are generated.

``finish_reason`` follows vLLM: ``"tool_calls"`` when an auto choice called tools or a
required choice stopped normally, the engine's reason otherwise (a named call finishes with
``"stop"``, as OpenAI's API). With ``parallel_tool_calls: false`` an auto choice keeps only
its first call (vLLM's rule).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from manylora.entrypoints.openai.errors import bad_request
from manylora.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, DeltaMessage
from manylora.entrypoints.openai.protocol_tools import (
    ChatCompletionNamedToolChoiceParam,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
    named_tool_schema,
    required_tools_schema,
)
from manylora.entrypoints.openai.tool_parsers import (
    RequiredToolCallsParser,
    StreamingToolExtractor,
    ToolDelta,
    ToolParser,
    get_tool_parser,
)
from manylora.sampling_params import SamplingParams
from manylora.structured_params import StructuredOutputsParams

__all__ = ["DEFAULT_MAX_TOOLS", "ToolPlan", "ToolStream", "merge_deltas", "template_tools"]

#: The most ``tools`` of one request (``--max-tools``): OpenAI's API allows 128 functions.
DEFAULT_MAX_TOOLS = 128

Mode = Literal["none", "auto", "required", "named"]


def template_tools(request: Any) -> list[dict[str, Any]] | None:
    """The request's ``tools`` as the chat template's ``tools=`` takes them (OpenAI's
    ``{"type": "function", "function": {...}}`` dicts, unset fields left out), or None."""
    tools = getattr(request, "tools", None)
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request's output relates to its tools (see the module docstring).

    Attributes:
        mode: ``none``, ``auto``, ``required`` or ``named``.
        parser: the format read from the output (auto: the server's parser; required:
            :class:`RequiredToolCallsParser`); None otherwise.
        function_name: the named choice's function.
        parallel: ``parallel_tool_calls`` (unset: true).
        structured: the output constraint of a required or named choice.
    """

    mode: Mode = "none"
    parser: ToolParser | None = None
    function_name: str | None = None
    parallel: bool = True
    structured: StructuredOutputsParams | None = None

    @classmethod
    def for_request(cls, request: ChatCompletionRequest, parser_name: str | None,
                    enable_auto_tool_choice: bool) -> ToolPlan:
        """The plan of a request that passed ``request.check()``.

        Args:
            parser_name: the server's ``--tool-call-parser``, or None.
            enable_auto_tool_choice: the server's ``--enable-auto-tool-choice``.

        Raises:
            OpenAIError: 400 (``tool_choice``): an auto choice (explicit, or the default
                with tools) on a server without ``--enable-auto-tool-choice`` and
                ``--tool-call-parser``; 400 (``tools``): conflicting ``$defs``.
        """
        choice = request.tool_choice
        parallel = request.parallel_tool_calls is not False
        if not request.tools or choice == "none":
            return cls()
        if choice is None or choice == "auto":
            if not (enable_auto_tool_choice and parser_name):
                raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                                  "--tool-call-parser to be set", param="tool_choice")
            return cls("auto", get_tool_parser(parser_name), parallel=parallel)
        if choice == "required":
            schema = required_tools_schema(request.tools, parallel)
            return cls("required", RequiredToolCallsParser(), parallel=parallel,
                       structured=StructuredOutputsParams(json=schema))
        assert isinstance(choice, ChatCompletionNamedToolChoiceParam)
        name = choice.function.name
        return cls("named", function_name=name, parallel=parallel,
                   structured=StructuredOutputsParams(json=named_tool_schema(request.tools,
                                                                             name)))

    def apply(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the plan's output constraint, and special tokens kept in the
        text when the auto parser's markers are special tokens (vLLM's
        ``adjust_request``)."""
        changes: dict[str, Any] = {}
        if self.structured is not None:
            changes["structured_outputs"] = self.structured
        if self.mode == "auto" and not self.parser.skip_special_tokens:
            changes["skip_special_tokens"] = False
        return dataclasses.replace(params, **changes) if changes else params

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """The choice's ``finish_reason`` given whether it called tools and the engine's
        reason (vLLM's rule, see the module docstring)."""
        if reason is None:
            return None
        if called and (self.mode == "auto" or (self.mode == "required" and reason == "stop")):
            return "tool_calls"
        return reason

    def message(self, text: str, reason: str | None) -> tuple[ChatMessage, str | None]:
        """A finished choice's message and ``finish_reason``, from its whole text."""
        if self.mode == "none":
            return ChatMessage(content=text), reason
        if self.mode == "named":
            call = ToolCall(function=FunctionCall(name=self.function_name, arguments=text))
            return ChatMessage(content=None, tool_calls=[call]), reason
        extracted = self.parser.extract_tool_calls(text)
        calls = extracted.tool_calls if self.parallel else extracted.tool_calls[:1]
        if not calls:
            return ChatMessage(content=text), reason
        return (ChatMessage(content=extracted.content, tool_calls=calls),
                self.finish_reason(True, reason))

    def stream(self) -> ToolStream | None:
        """The streamed extraction of one choice; None in mode ``none`` (text as is)."""
        return None if self.mode == "none" else ToolStream(self)


@dataclass
class ToolStream:
    """One streamed choice's text turned into deltas: content and tool call pieces (OpenAI's
    streamed shape), per the plan's mode.

    Args:
        plan: the request's :class:`ToolPlan` (not mode ``none``).
    """

    plan: ToolPlan
    _extractor: StreamingToolExtractor | None = field(default=None, init=False)
    _named_started: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.plan.parser is not None:
            self._extractor = self.plan.parser.streaming()

    @property
    def called(self) -> bool:
        """Whether a call has been streamed."""
        if self._extractor is not None:
            return self._extractor.tools_called
        return self._named_started

    def delta(self, text: str, finished: bool) -> DeltaMessage:
        """The delta for the choice's new ``text`` (everything left once ``finished``)."""
        if self.plan.mode == "named":
            pieces = [] if not text else [self._named_piece(text)]
            return merge_deltas([ToolDelta(tool_calls=pieces)])
        deltas = self._extractor.feed(text)
        if finished:
            deltas += self._extractor.finish()
        if not self.plan.parallel:
            for d in deltas:
                d.tool_calls = [p for p in d.tool_calls if p.index == 0]
        return merge_deltas(deltas)

    def _named_piece(self, text: str) -> DeltaToolCall:
        if self._named_started:
            return DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))
        self._named_started = True
        return DeltaToolCall(index=0, id=make_tool_call_id(), type="function",
                             function=DeltaFunctionCall(name=self.plan.function_name,
                                                        arguments=text))


def merge_deltas(deltas: list[ToolDelta]) -> DeltaMessage:
    """One chunk's ``DeltaMessage`` from several deltas: the content joined, and the tool
    call pieces of one call (one ``index``) merged into one piece (its ``id``, ``type`` and
    ``name`` kept, its ``arguments`` fragments joined), so that no chunk names one call
    twice."""
    content = "".join(d.content for d in deltas if d.content) or None
    merged: dict[int, DeltaToolCall] = {}
    for d in deltas:
        for piece in d.tool_calls:
            into = merged.get(piece.index)
            if into is None:
                merged[piece.index] = piece.model_copy(deep=True)
                continue
            into.id = into.id or piece.id
            into.type = into.type or piece.type
            fn = into.function or DeltaFunctionCall()
            other = piece.function or DeltaFunctionCall()
            fn.name = fn.name or other.name
            if other.arguments is not None:
                fn.arguments = (fn.arguments or "") + other.arguments
            into.function = fn
    calls = [merged[i] for i in sorted(merged)] or None
    return DeltaMessage(content=content, tool_calls=calls)
