"""Request, response and event bodies of ``POST /v1/responses`` (OpenAI's Responses API, for
text and function tools, with vLLM's sampling extras).

Field names and JSON shapes follow OpenAI's API reference, so that the official ``openai``
client parses every object and streamed event (``client.responses.create`` /
``client.responses.stream``). The request declares every field of OpenAI's
``responses.create`` (and vLLM's extras ``top_k``, ``seed``, ``stop``, ``ignore_eos``,
``repetition_penalty``, ``logit_bias``, ``skip_special_tokens``,
``include_stop_str_in_output``, ``chat_template_kwargs``, ``request_id``, ``priority``):
each is honoured or, for what this server cannot do (tools other than functions,
reasoning items, background runs, prompt templates, conversations, file and image inputs),
refused by
:meth:`ResponsesRequest.check` with a 400 naming it. Pydantic checks types strictly and
every client-chosen name (:mod:`~manylora.entrypoints.openai.validation`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    ValidationError,
    field_validator,
)

from manylora.entrypoints.openai.errors import bad_request
from manylora.entrypoints.openai.protocol import (
    INT64_MAX,
    INT64_MIN,
    ChatCompletionLogProbsContent,
    publish_sampling,
)
from manylora.entrypoints.openai.protocol_tools import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolsParam,
    FunctionCallParam,
    FunctionDefinition,
    check_tool_request,
)
from manylora.entrypoints.openai.validation import (
    ClientName,
    RequestModel,
    publish_rule,
    published_bounds,
    validation_error,
)
from manylora.sampling_params import MAX_LOGPROBS

__all__ = [
    "MAX_METADATA_PAIRS",
    "ResponseContentPartAddedEvent",
    "ResponseContentPartDoneEvent",
    "ResponseCreatedEvent",
    "ResponseErrorEvent",
    "ResponseFailedEvent",
    "ResponseFunctionCallArgumentsDeltaEvent",
    "ResponseFunctionCallArgumentsDoneEvent",
    "ResponseFunctionCallItem",
    "ResponseFunctionCallOutputItem",
    "ResponseFunctionTool",
    "ResponseFunctionToolCall",
    "ResponseInProgressEvent",
    "ResponseCompletedEvent",
    "ResponseInputMessage",
    "ResponseInputTextPart",
    "ResponseOutputItemAddedEvent",
    "ResponseOutputItemDoneEvent",
    "ResponseOutputMessage",
    "ResponseOutputText",
    "ResponseTextConfig",
    "ResponseTextDeltaEvent",
    "ResponseTextDoneEvent",
    "ResponseUsage",
    "ResponsesRequest",
    "ResponsesResponse",
    "STREAM_EVENTS",
    "responses_sse_content",
]

#: OpenAI's bounds on ``metadata``: at most 16 pairs, keys of at most 64 characters, values
#: of at most 512.
MAX_METADATA_PAIRS = 16
_MAX_METADATA_KEY = 64
_MAX_METADATA_VALUE = 512

#: ``metadata``: string pairs within OpenAI's bounds (published in the schema, so refused by
#: validation with a 400 naming ``metadata``).
Metadata = Annotated[
    dict[Annotated[str, StringConstraints(max_length=_MAX_METADATA_KEY)],
         Annotated[str, StringConstraints(max_length=_MAX_METADATA_VALUE)]],
    Field(max_length=MAX_METADATA_PAIRS)]

#: What OpenAI's ``include`` may name; only ``message.output_text.logprobs`` applies to a
#: text-only response (the others name tool and image outputs, refused by ``check``).
Includable = Literal[
    "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "file_search_call.results", "message.input_image.image_url",
    "message.output_text.logprobs", "reasoning.encrypted_content",
    "web_search_call.action.sources", "web_search_call.results"]


# ----------------------------------------------------------------------------- requests


class ResponseInputTextPart(RequestModel):
    """One text part of an input message's ``content``: ``input_text`` (user, system,
    developer) or ``output_text`` (an earlier assistant reply sent back; its
    ``annotations`` and ``logprobs`` are accepted and not used)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class ResponseInputMessage(RequestModel):
    """One message of ``input`` (OpenAI's ``EasyInputMessage`` and input/output message
    items): a role and its content as a string or text parts (joined with newlines, as
    chat content parts are). ``id`` and ``status`` of a replayed output message are
    accepted and not used."""

    type: Literal["message"] | None = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ResponseInputTextPart]
    id: ClientName | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        """The content as one string (parts joined with newlines)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ResponseFunctionCallItem(RequestModel):
    """A ``function_call`` item of ``input``: a call the model made earlier, sent back
    (OpenAI's shape; ``arguments`` is JSON text). ``id`` and ``status`` are accepted and
    not used."""

    type: Literal["function_call"]
    call_id: ClientName
    name: ClientName
    arguments: str
    id: ClientName | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @field_validator("arguments")
    @classmethod
    def _json_text(cls, value: str) -> str:
        return FunctionCallParam._json_text(value)


class ResponseFunctionCallOutputItem(RequestModel):
    """A ``function_call_output`` item of ``input``: the result of the call ``call_id``,
    as text or text parts (joined with newlines). ``id`` and ``status`` are accepted and
    not used."""

    type: Literal["function_call_output"]
    call_id: ClientName
    output: str | list[ResponseInputTextPart]
    id: ClientName | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        """The output as one string (parts joined with newlines)."""
        if isinstance(self.output, str):
            return self.output
        return "\n".join(part.text for part in self.output)


def _input_item_type(value: Any) -> str:
    """The kind of an ``input`` item (a message when ``type`` is left out)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function_call", "function_call_output") else "message"


#: One item of a list ``input``: a message, a function call or a function call's output.
ResponseInputItem = Annotated[
    Annotated[ResponseInputMessage, Tag("message")]
    | Annotated[ResponseFunctionCallItem, Tag("function_call")]
    | Annotated[ResponseFunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_input_item_type)]


class ResponseFunctionTool(RequestModel):
    """One function of ``tools``, in the Responses API's flat shape ``{"type":
    "function", "name", "description"?, "parameters"?, "strict"?}``."""

    type: Literal["function"]
    name: ClientName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat(self) -> ChatCompletionToolsParam:
        """The same tool in the chat route's nested shape (``{"type": "function",
        "function": {...}}``)."""
        return ChatCompletionToolsParam(function=FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters,
            strict=self.strict))


class TextFormatText(RequestModel):
    """``text.format`` ``{"type": "text"}``: free text (the default)."""

    type: Literal["text"]


class TextFormatJSONObject(RequestModel):
    """``text.format`` ``{"type": "json_object"}``: any JSON object."""

    type: Literal["json_object"]


class TextFormatJSONSchema(RequestModel):
    """``text.format`` ``{"type": "json_schema", "name", "schema", "strict"?,
    "description"?}``: one JSON value valid against ``schema``."""

    model_config = {**RequestModel.model_config, "populate_by_name": True}

    type: Literal["json_schema"]
    name: Annotated[str, StringConstraints(min_length=1, max_length=64,
                                           pattern=r"^[a-zA-Z0-9_-]+$")]
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseTextConfig(RequestModel):
    """``text``: the output's format and (accepted, a hint only) ``verbosity``."""

    format: TextFormatText | TextFormatJSONObject | TextFormatJSONSchema | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


def _publish_no_reasoning(schema: dict[str, Any]) -> None:
    """Publish what ``ResponsesRequest.check`` accepts of ``reasoning``: no effort but
    ``none``, no summary (validation stays wider, so that the 400 gives the reason)."""
    null, props = {"type": "null"}, schema["properties"]
    props["effort"] = {"anyOf": [{"const": "none", "type": "string"}, null], "default": None,
                       "description": "only 'none' is supported (no reasoning parser)"}
    for name in ("summary", "generate_summary"):
        props[name] = {**null, "default": None,
                       "description": "not supported (no reasoning parser)"}


class ReasoningConfig(RequestModel):
    """``reasoning``; a set ``effort`` or ``summary`` is refused (no reasoning parser; the
    published schema admits only their unset values)."""

    model_config = ConfigDict(json_schema_extra=_publish_no_reasoning)

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponseStreamOptions(RequestModel):
    """``stream_options``: ``include_obfuscation`` (this server adds no obfuscation field,
    whatever it says)."""

    include_obfuscation: bool | None = None


_FUNCTION_TOOL_SCHEMA = ResponseFunctionTool.model_json_schema()
_NAMED_CHOICE_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["type", "name"],
    "properties": {"type": {"const": "function", "type": "string"},
                   "name": ResponseFunctionTool.model_json_schema()["properties"]["name"]}}


def _publish_checks(schema: dict[str, Any]) -> None:
    """Narrow the published schema of :class:`ResponsesRequest` to what ``check`` accepts
    (bounds, and only the unset values of the unsupported fields, the reason in their
    description): the document says what the server enforces, while validation stays
    permissive so that ``check`` answers with the reason."""
    props = schema["properties"]
    bounds = {"max_output_tokens": {"minimum": 1}, "max_tool_calls": {"minimum": 1},
              "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
              "seed": {"format": "int64", "minimum": INT64_MIN, "maximum": INT64_MAX}}
    for name, bound in bounds.items():
        published_bounds(**bound)(props[name])
    publish_sampling(schema)
    publish_rule(schema, {"previous_response_id": {"type": "string"}},
                 {"store": {"enum": [True, None]}}, required=False)
    for member in props["include"]["anyOf"]:
        if member.get("type") == "array":
            member["items"] = {"const": "message.output_text.logprobs", "type": "string"}
    props["input"]["anyOf"] = [{**o, "minItems": 1} if o.get("type") == "array" else o
                               for o in props["input"]["anyOf"]]
    null, empty_list = {"type": "null"}, {"type": "array", "maxItems": 0}
    empty_object = {"type": "object", "maxProperties": 0}
    props["tools"] = {"anyOf": [{"type": "array", "items": _FUNCTION_TOOL_SCHEMA}, null],
                      "default": None, "description": "function tools only"}
    props["tool_choice"] = {"anyOf": [{"enum": ["none", "auto", "required"]},
                                      _NAMED_CHOICE_SCHEMA, null], "default": None}
    unset = {"background": [null, {"const": False}],
             "prompt": [null, empty_object],
             "conversation": [null, {"const": ""}, empty_object],
             "context_management": [null, empty_list],
             "service_tier": [null, {"enum": ["auto", "default"]}],
             "prompt_cache_retention": [null, {"const": "in_memory"}],
             "priority": [null, {"const": 0}]}
    for name, options in unset.items():
        props[name] = {"anyOf": options, "description": "only these values are supported",
                       **({"default": props[name]["default"]} if "default" in props[name]
                          else {})}


class ResponsesRequest(RequestModel):
    """Body of ``POST /v1/responses``: OpenAI's ``responses.create`` for text, with vLLM's
    extras. ``input`` is one user text or a list of messages, ``function_call`` and
    ``function_call_output`` items; ``instructions`` becomes a leading system message
    (OpenAI's and vLLM's rendering). ``tools`` are function tools in the flat Responses
    shape (kept as dicts by validation so that :meth:`check` names a refused type). The
    published schema is
    narrowed to what :meth:`check` accepts (``_publish_checks``)."""

    model_config = ConfigDict(json_schema_extra=_publish_checks)

    model: ClientName | None = None
    input: str | list[ResponseInputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[Includable] | None = None
    stream: bool | None = False
    stream_options: ResponseStreamOptions | None = None
    store: bool | None = True
    previous_response_id: ClientName | None = None
    user: ClientName | None = None
    safety_identifier: ClientName | None = None
    metadata: Metadata | None = None
    text: ResponseTextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: ClientName | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    # refused unless empty / unset (see check)
    reasoning: ReasoningConfig | None = None
    background: bool | None = False
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    # vLLM's extras
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = False
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    request_id: ClientName | None = None
    priority: int | None = 0

    def wants_logprobs(self) -> bool:
        """Whether ``include`` asks for the output text's log-probabilities."""
        return "message.output_text.logprobs" in (self.include or ())

    def check(self) -> None:
        """Reject values this server does not support, each with a 400 naming its field.

        Raises:
            OpenAIError: 400 for: an empty ``input`` list; ``max_output_tokens`` or
                ``max_tool_calls`` below 1; ``top_logprobs`` outside ``[0, MAX_LOGPROBS]``;
                an ``include`` other than ``message.output_text.logprobs``; a ``seed``
                outside the signed 64-bit range; ``stream_options`` without ``stream``;
                a tool other than a function, a malformed tool, two tools of one name,
                a ``tool_choice`` other than ``none`` without tools, naming no tool, or
                forcing a call with a JSON ``text.format``, output logprobs with tools
                that may be called; a ``reasoning``
                effort or summary; ``background``; a ``prompt`` template; a
                ``conversation``; ``context_management``; a ``service_tier`` other than
                ``auto`` / ``default``; ``prompt_cache_retention`` ``24h``; a non-zero
                ``priority``; ``previous_response_id`` with ``store`` false.
        """
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input must not be an empty list", param="input")
        for name in ("max_output_tokens", "max_tool_calls"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise bad_request(f"{name} must be at least 1, got {value}", param=name)
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                              f"top_logprobs={self.top_logprobs}", param="top_logprobs")
        for item in self.include or ():
            if item != "message.output_text.logprobs":
                raise bad_request(f"include {item!r} is not supported: this server returns "
                                  "text only ('message.output_text.logprobs' is)",
                                  param="include")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise bad_request(f"seed must be in [{INT64_MIN}, {INT64_MAX}], got "
                              f"seed={self.seed}", param="seed")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              param="stream_options")
        self._check_unsupported()

    def chat_tools(self) -> list[ChatCompletionToolsParam] | None:
        """``tools`` in the chat route's nested shape, or None without tools.

        Raises:
            OpenAIError: 400 (``tools[i].type``) for a tool type other than ``function``
                (``web_search``, ``file_search``, ...), naming it; 400 naming the field of
                a malformed function tool.
        """
        if not self.tools:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind != "function":
                raise bad_request(f"tools[{i}] has type {kind!r}, which this server does not "
                                  "support; only 'function' tools are", param=f"tools[{i}].type")
            try:
                tools.append(ResponseFunctionTool.model_validate(tool).to_chat())
            except ValidationError as e:
                raise validation_error([{**err, "loc": ("body", "tools", i, *err["loc"])}
                                        for err in e.errors()]) from None
        return tools

    def chat_tool_choice(self) -> str | ChatCompletionNamedToolChoiceParam | None:
        """``tool_choice`` as the chat route takes it: ``none`` / ``auto`` / ``required``
        as is, the flat ``{"type": "function", "name"}`` as the nested named choice.

        Raises:
            OpenAIError: 400 (``tool_choice``) for any other object (``allowed_tools``,
                hosted tool types, a malformed function choice), naming its type.
        """
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return choice
        if (choice.get("type") != "function" or set(choice) != {"type", "name"}
                or not isinstance(choice["name"], str)):
            raise bad_request(f"tool_choice of type {choice.get('type')!r} is not supported; "
                              "give 'none', 'auto', 'required' or {'type': 'function', "
                              "'name': <one of tools>}", param="tool_choice")
        try:
            return ChatCompletionNamedToolChoiceParam(function={"name": choice["name"]})
        except ValidationError as e:
            raise validation_error([{**err, "loc": ("body", "tool_choice", "name")}
                                    for err in e.errors()]) from None

    def _check_tools(self) -> None:
        """The 400s of ``tools`` and ``tool_choice`` (the chat route's rules, with the
        Responses API's names)."""
        tools, choice = self.chat_tools(), self.chat_tool_choice()
        check_tool_request(tools, choice, constrained=False)
        fmt = self.text.format if self.text is not None else None
        forced = tools and choice not in (None, "none", "auto")
        if forced and isinstance(fmt, (TextFormatJSONObject, TextFormatJSONSchema)):
            raise bad_request("a required or named tool_choice constrains the output itself; "
                              "it cannot be combined with a JSON text.format",
                              param="tool_choice")
        if tools and choice != "none" and self.wants_logprobs():
            raise bad_request("include 'message.output_text.logprobs' is not supported with "
                              "tools that may be called (tool_choice 'none' allows it)",
                              param="include")

    def _check_unsupported(self) -> None:
        """The 400s for features this server does not serve."""
        self._check_tools()
        if self.reasoning is not None and any(
                v not in (None, "none") for v in (self.reasoning.effort, self.reasoning.summary,
                                                  self.reasoning.generate_summary)):
            raise bad_request("reasoning is not supported (no reasoning parser is configured)",
                              param="reasoning")
        unsupported = {
            "background": "background responses are not supported",
            "prompt": "prompt templates are not supported",
            "conversation": "conversations are not supported; use previous_response_id",
            "context_management": "context_management is not supported",
        }
        for name, why in unsupported.items():
            if getattr(self, name):
                raise bad_request(why, param=name)
        if self.service_tier not in (None, "auto", "default"):
            raise bad_request(f"service_tier {self.service_tier!r} is not supported; this "
                              "server has one tier ('auto' / 'default')", param="service_tier")
        if self.prompt_cache_retention == "24h":
            raise bad_request("prompt_cache_retention '24h' is not supported; the prefix "
                              "cache is in memory", param="prompt_cache_retention")
        if self.priority:
            raise bad_request(f"priority must be 0 (no priority scheduling), got "
                              f"{self.priority}", param="priority")
        if self.previous_response_id is not None and self.store is False:
            raise bad_request("previous_response_id needs store (the previous response "
                              "must have been stored)", param="previous_response_id")


# ---------------------------------------------------------------------------- responses


class ResponseOutputText(BaseModel):
    """An ``output_text`` content part: the text, no annotations, and per token its
    log-probabilities when ``include`` asked for them."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[ChatCompletionLogProbsContent] | None = None


class ResponseOutputMessage(BaseModel):
    """The assistant's ``message`` output item."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponseOutputText]


class ResponseFunctionToolCall(BaseModel):
    """A ``function_call`` output item: a call of one of ``tools``, its ``arguments`` as
    JSON text; ``call_id`` is what a ``function_call_output`` item answers."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


#: One output item: the assistant's message or a function call.
ResponseOutputItem = Annotated[ResponseOutputMessage | ResponseFunctionToolCall,
                               Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    """``usage.input_tokens_details``: prompt tokens read from the prefix cache (not
    reported by the engine per request: 0)."""

    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    """``usage.output_tokens_details``: no reasoning tokens (no reasoning parser)."""

    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """Token counts of a response."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    """Why a response is ``incomplete``: ``max_output_tokens`` (or the context) cut it."""

    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    """A failed response's ``error``."""

    code: str
    message: str


class ResponsesResponse(BaseModel):
    """OpenAI's ``Response`` object: the output and the request's settings echoed.

    ``status``: ``in_progress`` (in streamed lifecycle events), ``completed``,
    ``incomplete`` (``incomplete_details.reason`` says why) or ``failed`` (``error``).
    """

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[ResponseOutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str = "default"
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int = 0
    top_p: float = 1.0
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False

    def output_text(self) -> str:
        """The assistant's text, all parts joined (the ``openai`` client's
        ``output_text``)."""
        return "".join(part.text for item in self.output if item.type == "message"
                       for part in item.content)


# ------------------------------------------------------------------------------- events


class _Event(BaseModel):
    sequence_number: int


class _ContentEvent(_Event):
    """An event about one content part of one output item."""

    item_id: str
    output_index: int
    content_index: int


class ResponseCreatedEvent(_Event):
    """``response.created``: the response, ``in_progress``, no output yet."""

    type: Literal["response.created"] = "response.created"
    response: ResponsesResponse


class ResponseInProgressEvent(_Event):
    """``response.in_progress``."""

    type: Literal["response.in_progress"] = "response.in_progress"
    response: ResponsesResponse


class ResponseOutputItemAddedEvent(_Event):
    """``response.output_item.added``: a message item, ``in_progress``, no content, or a
    function call, ``in_progress``, its name and no arguments yet."""

    type: Literal["response.output_item.added"] = "response.output_item.added"
    output_index: int
    item: ResponseOutputItem


class ResponseContentPartAddedEvent(_ContentEvent):
    """``response.content_part.added``: an empty ``output_text`` part."""

    type: Literal["response.content_part.added"] = "response.content_part.added"
    part: ResponseOutputText


class ResponseTextDeltaEvent(_ContentEvent):
    """``response.output_text.delta``: the new text (and its tokens' log-probabilities
    when asked for)."""

    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    logprobs: list[ChatCompletionLogProbsContent] = Field(default_factory=list)


class ResponseTextDoneEvent(_ContentEvent):
    """``response.output_text.done``: the whole text."""

    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str
    logprobs: list[ChatCompletionLogProbsContent] = Field(default_factory=list)


class ResponseContentPartDoneEvent(_ContentEvent):
    """``response.content_part.done``: the finished part."""

    type: Literal["response.content_part.done"] = "response.content_part.done"
    part: ResponseOutputText


class ResponseOutputItemDoneEvent(_Event):
    """``response.output_item.done``: the finished message or function call item."""

    type: Literal["response.output_item.done"] = "response.output_item.done"
    output_index: int
    item: ResponseOutputItem


class ResponseFunctionCallArgumentsDeltaEvent(_Event):
    """``response.function_call_arguments.delta``: a fragment of a call's arguments."""

    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta")
    item_id: str
    output_index: int
    delta: str


class ResponseFunctionCallArgumentsDoneEvent(_Event):
    """``response.function_call_arguments.done``: a call's whole arguments."""

    type: Literal["response.function_call_arguments.done"] = (
        "response.function_call_arguments.done")
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseCompletedEvent(_Event):
    """``response.completed``: the final response (status ``completed``, or ``incomplete``
    with its reason, as vLLM sends it)."""

    type: Literal["response.completed"] = "response.completed"
    response: ResponsesResponse


class ResponseFailedEvent(_Event):
    """``response.failed``: the response, status ``failed``, with its ``error``."""

    type: Literal["response.failed"] = "response.failed"
    response: ResponsesResponse


class ResponseErrorEvent(_Event):
    """``error``: an error met after streaming began (before ``response.failed``)."""

    type: Literal["error"] = "error"
    code: str | None = None
    message: str
    param: str | None = None


#: Every event a streamed response sends, in the order of a successful stream (a function
#: call item's argument events in place of a message's content events), then the two of a
#: failed one.
STREAM_EVENTS: tuple[type[_Event], ...] = (
    ResponseCreatedEvent, ResponseInProgressEvent, ResponseOutputItemAddedEvent,
    ResponseContentPartAddedEvent, ResponseTextDeltaEvent, ResponseTextDoneEvent,
    ResponseContentPartDoneEvent, ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent, ResponseOutputItemDoneEvent,
    ResponseCompletedEvent,
    ResponseErrorEvent, ResponseFailedEvent)


def responses_sse_content() -> dict[str, Any]:
    """The ``text/event-stream`` entry of ``POST /v1/responses``'s 200 in the OpenAPI
    document: per event, ``event`` is its type and ``data`` one of :data:`STREAM_EVENTS` as
    JSON (their schemas join the document's components through ``install_openapi``'s
    ``stream_chunks``)."""
    events = [{"$ref": f"#/components/schemas/{e.__name__}"} for e in STREAM_EVENTS]
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["event", "data"],
        "description": "One server-sent event: 'event: <type>' and 'data: <event JSON>', "
                       "sequence_number counting from 0; no [DONE] (OpenAI's framing).",
        "properties": {
            "event": {"type": "string"},
            "data": {"type": "string", "contentMediaType": "application/json",
                     "contentSchema": {"anyOf": events}}}}}}
