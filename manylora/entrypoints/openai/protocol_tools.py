"""Tool calling's request and response shapes (OpenAI's, as vLLM declares them) and the JSON
schemas that make ``tool_choice: "required"`` and a named choice a guarantee.

Request side (strict :class:`~manylora.entrypoints.openai.validation.RequestModel` s, so a
malformed tool, tool choice or tool call in the history is a 400 naming the field):
``tools`` (:class:`ChatCompletionToolsParam`), a named ``tool_choice``
(:class:`ChatCompletionNamedToolChoiceParam`) and an assistant message's ``tool_calls``
(:class:`ToolCallParam`, whose ``arguments`` must be JSON text).

Response side: :class:`ToolCall` on ``ChatMessage.tool_calls``, :class:`DeltaToolCall` on a
streamed ``DeltaMessage.tool_calls`` (OpenAI's streamed shape: ``index``, ``id``, ``type``
and the function's ``name`` first, then ``arguments`` fragments; unset fields stay out of
the JSON).

Schemas (vLLM's ``_get_json_schema_from_tool``): :func:`named_tool_schema` and
:func:`required_tools_schema`, handed to the grammar engine as
``StructuredOutputsParams(json=schema)``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_serializer

from manylora.entrypoints.openai.errors import bad_request
from manylora.entrypoints.openai.validation import ClientName, RequestModel

__all__ = [
    "ChatCompletionNamedToolChoiceParam",
    "ChatCompletionToolsParam",
    "DeltaFunctionCall",
    "DeltaToolCall",
    "FunctionCall",
    "FunctionCallParam",
    "FunctionDefinition",
    "NamedFunction",
    "ToolCall",
    "ToolCallParam",
    "check_tool_request",
    "make_tool_call_id",
    "named_tool_schema",
    "required_tools_schema",
]

#: The parameters schema of a tool that declares none: an object of any properties.
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def make_tool_call_id() -> str:
    """A fresh tool call id, vLLM's form: ``chatcmpl-tool-<32 hex digits>``."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------ requests


class FunctionDefinition(RequestModel):
    """A tool's function: its ``name``, ``description``, ``parameters`` (a JSON schema of
    the arguments object) and OpenAI's ``strict`` (accepted; a named or required choice is
    always enforced by the grammar, auto calls are parsed from free text)."""

    name: ClientName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def parameters_schema(self) -> dict[str, Any]:
        """``parameters``, or an object of any properties when the tool declares none."""
        return self.parameters if self.parameters is not None else dict(EMPTY_PARAMETERS)


class ChatCompletionToolsParam(RequestModel):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    """The function a named ``tool_choice`` forces."""

    name: ClientName


class ChatCompletionNamedToolChoiceParam(RequestModel):
    """A named ``tool_choice``: ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCallParam(RequestModel):
    """The function of a tool call in the history: its name and its arguments as JSON
    text (OpenAI's shape; the chat template gets them parsed, as vLLM passes them).

    Raises:
        pydantic.ValidationError: ``arguments`` is not valid JSON (the 400 names
            ``messages[i].tool_calls[j].function.arguments``).
    """

    name: ClientName
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_text(cls, value: str) -> str:
        if value.strip():
            try:
                json.loads(value)
            except ValueError as e:
                raise ValueError(f"must be JSON text (the function's arguments): {e}") from None
        return value

    def parsed_arguments(self) -> Any:
        """The arguments as the chat template takes them: the parsed JSON value, ``{}``
        for empty text (vLLM's rule)."""
        return json.loads(self.arguments) if self.arguments.strip() else {}


class ToolCallParam(RequestModel):
    """A tool call of an assistant message in the history."""

    id: ClientName
    type: Literal["function"] = "function"
    function: FunctionCallParam

    def to_template(self) -> dict[str, Any]:
        """The call as chat templates (transformers' convention) take it: ``{"id",
        "type", "function": {"name", "arguments": <parsed JSON>}}``."""
        return {"id": self.id, "type": self.type,
                "function": {"name": self.function.name,
                             "arguments": self.function.parsed_arguments()}}


# ----------------------------------------------------------------------------- responses


def _drop_none(handler, model: BaseModel) -> dict[str, Any]:
    return {k: v for k, v in handler(model).items() if v is not None}


class FunctionCall(BaseModel):
    """A generated call's function: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One generated tool call of ``ChatMessage.tool_calls``."""

    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    """The function part of a streamed tool call piece: the ``name`` (first piece only)
    and/or an ``arguments`` fragment; unset fields are left out of the JSON."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        return _drop_none(handler, self)


class DeltaToolCall(BaseModel):
    """One streamed tool call piece (OpenAI's shape): ``index`` (the call's place in the
    message) always; ``id`` and ``type`` on the call's first piece only; unset fields are
    left out of the JSON."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        return _drop_none(handler, self)


# ------------------------------------------------------------------------------- checks


def check_tool_request(tools: list[ChatCompletionToolsParam] | None,
                       tool_choice: str | ChatCompletionNamedToolChoiceParam | None,
                       constrained: bool) -> None:
    """The checks on ``tools`` and ``tool_choice`` that need no server setting (vLLM's
    ``check_tool_usage``).

    Args:
        tools: the request's tools (None or empty: none).
        tool_choice: the request's choice.
        constrained: whether the request also asks for another output constraint
            (``response_format`` json, ``structured_outputs``), which a required or named
            choice cannot share.

    Raises:
        OpenAIError: 400 (``tool_choice``): a choice other than ``"none"`` without tools,
            a named function that is not one of ``tools``, or a required or named choice
            with another output constraint; 400 (``tools``): two tools of one name.
    """
    names = [t.function.name for t in tools or ()]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad_request(f"tools holds two functions named {dup!r}; names must be unique",
                          param="tools")
    if tool_choice is None or tool_choice == "none":
        return
    if not names:
        raise bad_request("when tool_choice is set (other than 'none'), tools must be set",
                          param="tool_choice")
    if isinstance(tool_choice, ChatCompletionNamedToolChoiceParam):
        if tool_choice.function.name not in names:
            raise bad_request(f"tool_choice names the function {tool_choice.function.name!r}, "
                              "which is not one of tools", param="tool_choice")
    if constrained and tool_choice != "auto":
        raise bad_request("a required or named tool_choice constrains the output itself; it "
                          "cannot be combined with response_format or structured_outputs",
                          param="tool_choice")


# ------------------------------------------------------------------------------ schemas


def named_tool_schema(tools: list[ChatCompletionToolsParam], name: str) -> dict[str, Any]:
    """The JSON schema of a named choice's output: the named tool's ``parameters`` (the
    output is the arguments object itself, as vLLM).

    Raises:
        KeyError: no tool is named ``name`` (:func:`check_tool_request` ran first).
    """
    tool = next(t for t in tools if t.function.name == name)
    return tool.function.parameters_schema()


def _hoist_defs(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``$defs`` of several tools' parameters, merged for the root of one schema (their
    ``$ref`` s point at the root: ``#/$defs/X``).

    Raises:
        OpenAIError: 400 (``tools``): two tools define one name differently.
    """
    merged: dict[str, Any] = {}
    for schema in schemas:
        defs = schema.get("$defs")
        for name, definition in (defs if isinstance(defs, dict) else {}).items():
            if name in merged and merged[name] != definition:
                raise bad_request(f"two tools' parameters define $defs {name!r} "
                                  "differently", param="tools")
            merged[name] = definition
    return merged


def required_tools_schema(tools: list[ChatCompletionToolsParam],
                          parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of a required choice's output (vLLM's): an array of at least one
    (at most one when ``parallel`` is false) object ``{"name": <one tool's name>,
    "parameters": <that tool's parameters>}``, every tool's ``$defs`` hoisted to the root.

    Raises:
        OpenAIError: 400 (``tools``) for conflicting ``$defs``.
    """
    params = [t.function.parameters_schema() for t in tools]
    options = [{"properties": {"name": {"type": "string", "enum": [t.function.name]},
                               "parameters": p},
                "required": ["name", "parameters"]}
               for t, p in zip(tools, params)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    defs = _hoist_defs(params)
    if defs:
        schema["$defs"] = defs
    return schema
