"""Request and response bodies of ``/v1/completions`` and ``/v1/chat/completions``.

Field names, defaults and JSON shapes follow OpenAI's API (so the official ``openai``
client parses every response) plus vLLM's sampling extras (``top_k``, ``min_p``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output``, and for chat ``add_generation_prompt``,
``continue_final_message`` and ``chat_template_kwargs``); the rest of vLLM's fields come from
:mod:`~manylora.entrypoints.openai.vllm_fields` (the request bodies' bases), which also logs
unknown fields as ignored, as vLLM does.

Pydantic checks the types, strictly as OpenAI does, every string's encoding and every
client-chosen name (:mod:`~manylora.entrypoints.openai.validation`);
:meth:`CompletionRequest.check` and
:meth:`ChatCompletionRequest.check` then reject values this server does not support, with an
:class:`~manylora.entrypoints.openai.errors.OpenAIError` (400) naming the parameter.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    model_serializer,
    model_validator,
)

from manylora.entrypoints.openai.echo import PromptLogprobEntry, check_prompt_logprobs
from manylora.entrypoints.openai.errors import bad_request
from manylora.entrypoints.openai.protocol_structured import ResponseFormat, StructuredFields
from manylora.entrypoints.openai.protocol_tools import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolsParam,
    DeltaToolCall,
    ToolCall,
    ToolCallParam,
    check_tool_request,
)
from manylora.entrypoints.openai.validation import (
    ClientName,
    RequestModel,
    publish_bounds,
    publish_rule,
    published_bounds,
)
from manylora.entrypoints.openai.vllm_fields import (
    ChatFields,
    CompletionFields,
    _publish_refusals,
)
from manylora.sampling_params import MAX_LOGPROBS

# The most choices one request may ask for (``n``).
MAX_N = 128

# Seeds must fit a signed 64-bit integer (a torch generator's seed), as in vLLM; choice
# ``i`` of a prompt is seeded with ``seed + i``, wrapped into that range.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

_SEED_BOUNDS = published_bounds(format="int64", minimum=INT64_MIN, maximum=INT64_MAX)
_N_BOUNDS = published_bounds(minimum=1, maximum=MAX_N)

#: The bounds of the sampling fields, as ``SamplingParams`` and the checks here enforce them
#: (published on both generation routes, and on ``/v1/responses`` for the fields it has).
SAMPLING_BOUNDS: dict[str, dict[str, Any]] = {
    "temperature": {"minimum": 0}, "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1}, "min_p": {"minimum": 0, "maximum": 1},
    "max_tokens": {"minimum": 1}, "max_completion_tokens": {"minimum": 1},
    "min_tokens": {"minimum": 0}, "frequency_penalty": {"minimum": -2, "maximum": 2},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "prompt_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
}
_NOT_EMPTY = {"type": "string", "minLength": 1}
_TRUE, _NOT_TRUE = {"const": True}, {"enum": [False, None]}


def publish_sampling(schema: dict[str, Any]) -> None:
    """Narrow a generation body's published schema to what the server accepts of its
    sampling fields (:data:`SAMPLING_BOUNDS`; non-empty ``stop`` strings; ``logit_bias``
    keyed by token ids, biases in [-100, 100]; ``allowed_token_ids`` not empty, none below
    0) and state the rules between fields: ``stream_options`` only with ``stream``,
    ``prompt_logprobs`` above 0 only without it. What no schema states stays with the
    checks: a token id's upper bound (the vocabulary), ``min_tokens`` above ``max_tokens``,
    the prompt and ``max_tokens`` over the context."""
    publish_bounds(schema, SAMPLING_BOUNDS)
    props = schema["properties"]
    for member in props.get("stop", {}).get("anyOf", ()):
        if member.get("type") == "string":
            member.update(minLength=1)
        elif member.get("type") == "array":
            member["items"] = _NOT_EMPTY
    for member in props.get("allowed_token_ids", {}).get("anyOf", ()):
        if member.get("type") == "array":
            member.update(items={"type": "integer", "minimum": 0}, minItems=1)
    for member in props.get("logit_bias", {}).get("anyOf", ()):
        if member.get("type") == "object":
            member.update(propertyNames={"pattern": "^[0-9]+$"}, additionalProperties={
                "type": "number", "minimum": -100, "maximum": 100})
    # one rule on stream: with it no prompt_logprobs above 0, without it no stream_options
    publish_rule(schema, {"stream": _TRUE},
                 {"prompt_logprobs": {"maximum": 0}} if "prompt_logprobs" in props else {},
                 required=False, otherwise={"stream_options": {"type": "null"}})


def _publish_generation(schema: dict[str, Any], model: type) -> None:
    """The published schema of a generation body: vLLM's refused fields narrowed to their
    unset values (``_publish_refusals``), the sampling fields' bounds and rules
    (:func:`publish_sampling`), ``truncate_prompt_tokens`` -1 or at least 1, on completions
    ``max_tokens`` 0 only with ``echo``, and on chat
    ``top_logprobs`` above 0 only with ``logprobs``, ``continue_final_message`` only without
    ``add_generation_prompt``, a ``tool_choice`` other than ``none`` only with ``tools``
    (one rule, whose other branch :func:`publish_no_auto_tool_choice` fills)."""
    _publish_refusals(schema, model)
    publish_sampling(schema)
    props = schema["properties"]
    props["truncate_prompt_tokens"]["anyOf"] = [
        {"const": -1}, {"type": "integer", "minimum": 1}, {"type": "null"}]
    if "prompt" in props:           # max_tokens 0 echoes the prompt alone (vLLM's)
        publish_bounds(schema, {"max_tokens": {"minimum": 0}})
        publish_rule(schema, {"max_tokens": {"const": 0}}, {"echo": _TRUE})
    if "messages" in props:
        publish_rule(schema, {"top_logprobs": {"type": "integer", "minimum": 1}},
                     {"logprobs": _TRUE})
        publish_rule(schema, {"continue_final_message": _TRUE},
                     {"add_generation_prompt": _NOT_TRUE})
        # without tools, no tool_choice but none; with tools, see publish_no_auto_tool_choice
        publish_rule(schema, {"tools": {"type": "array", "minItems": 1}}, {}, required=False,
                     otherwise={"tool_choice": {"enum": ["none", None]}})


def publish_no_request_chat_template(doc: dict[str, Any]) -> None:
    """Narrow the OpenAPI document ``doc`` of a server without
    ``--trust-request-chat-template``: a chat request's ``chat_template`` is null and its
    ``chat_template_kwargs`` hold no ``chat_template`` (both refused, as vLLM refuses them)."""
    props = (doc.get("components", {}).get("schemas", {}).get("ChatCompletionRequest", {})
             .get("properties", {}))
    if "chat_template" in props:
        props["chat_template"] = {"type": "null", "description": "refused: the server runs "
                                  "without --trust-request-chat-template"}
    for member in props.get("chat_template_kwargs", {}).get("anyOf", ()):
        if member.get("type") == "object":
            member["properties"] = {"chat_template": False}


def publish_no_auto_tool_choice(doc: dict[str, Any]) -> None:
    """Narrow the OpenAPI document ``doc`` of a server without ``--enable-auto-tool-choice``
    (and a ``--tool-call-parser``): a chat request with tools then needs a ``tool_choice``
    of ``none``, ``required`` or a named function (the auto default is refused, as vLLM
    refuses it)."""
    schema = doc.get("components", {}).get("schemas", {}).get("ChatCompletionRequest", {})
    for rule in schema.get("allOf", ()):
        if "tools" in rule.get("if", {}).get("properties", {}):
            rule["then"] = {"properties": {"tool_choice": {"anyOf": [
                {"enum": ["none", "required"]}, {"type": "object"}]}},
                "required": ["tool_choice"]}

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "MAX_N",
    "ChatCompletionLogProb",
    "ChatCompletionLogProbs",
    "ChatCompletionLogProbsContent",
    "ChatCompletionMessageParam",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatCompletionStreamChoice",
    "ChatCompletionStreamResponse",
    "ChatMessage",
    "CompletionLogProbs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionResponseChoice",
    "CompletionStreamChoice",
    "CompletionStreamResponse",
    "ContentPart",
    "DeltaMessage",
    "ResponseFormat",
    "StreamOptions",
    "UsageInfo",
]


class StreamOptions(RequestModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage (and
    ``"usage": null`` on every other chunk); ``continuous_usage_stats`` (vLLM) puts the usage
    so far on every chunk."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


def _check_common(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Checks shared by both request kinds.

    Raises:
        OpenAIError: 400 naming the parameter: ``n`` outside ``[1, MAX_N]``, a ``seed``
            outside the signed 64-bit range, a non-zero
            ``presence_penalty`` or ``frequency_penalty``, a non-empty ``logit_bias``, or
            ``stream_options`` without ``stream``.
    """
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got n={req.n}", param="n")
    if req.seed is not None and not INT64_MIN <= req.seed <= INT64_MAX:
        raise bad_request(f"seed must be in [{INT64_MIN}, {INT64_MAX}], got seed={req.seed}",
                          param="seed")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          param="stream_options")


_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
# what check() admits: no prompt, text or token-id list is empty (the upper bound of a token
# id, the vocabulary's size, is checked with the tokenizer)
_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    _TOKEN_IDS, {"type": "array", "minItems": 1, "items": _TOKEN_IDS}],
    "title": "Prompt", "description": "a text, texts, a list of token ids, or lists of token "
                                      "ids; none of them empty"}


class CompletionRequest(StructuredFields, CompletionFields):
    """Body of ``POST /v1/completions`` (OpenAI's legacy completions, with vLLM's extras).

    ``prompt`` is one text, a list of texts, one list of token ids, or a list of lists of
    token ids; every prompt gets ``n`` choices, choice index ``prompt_index * n + i``.
    """

    model_config = ConfigDict(json_schema_extra=_publish_generation)

    model: ClientName | None = None
    prompt: Annotated[str | list[str] | list[int] | list[list[int]],
                      WithJsonSchema(_PROMPT_SCHEMA)]
    best_of: int | None = None
    echo: bool | None = False
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = Field(
        default=None, json_schema_extra=published_bounds(minimum=0, maximum=MAX_LOGPROBS))
    max_tokens: int | None = 16
    n: int | None = Field(default=1, json_schema_extra=_N_BOUNDS)
    presence_penalty: float | None = None
    seed: int | None = Field(default=None, json_schema_extra=_SEED_BOUNDS)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: ClientName | None = None
    # vLLM's extras (``return_tokens_as_token_ids``: log-probability tokens as
    # ``token_id:<id>``)
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = 0
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    return_tokens_as_token_ids: bool | None = False
    prompt_logprobs: int | None = None
    repetition_penalty: float | None = None
    allowed_token_ids: list[int] | None = None

    def check(self) -> None:
        """Reject values this server does not support.

        Raises:
            OpenAIError: 400 naming the parameter: those of the shared checks (``n``,
                ``stream_options``), a ``best_of`` other than
                None or ``n``, a non-null ``suffix``, ``logprobs`` outside
                ``[0, MAX_LOGPROBS]``, ``prompt_logprobs`` as
                :func:`~manylora.entrypoints.openai.echo.check_prompt_logprobs`, or an
                empty ``prompt``, ``prompt`` list or text or token-id list in it (as the
                published schema says, whatever the tokenizer would add to it).
        """
        _check_common(self)
        n = self.n or 1
        if self.best_of is not None and self.best_of != n:
            raise bad_request(f"best_of must be equal to n ({n}) or unset, got "
                              f"best_of={self.best_of}", param="best_of")
        if self.suffix is not None:
            raise bad_request("suffix is not supported", param="suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got "
                              f"logprobs={self.logprobs}", param="logprobs")
        check_prompt_logprobs(self.prompt_logprobs, self.stream)
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("prompt must not be an empty list", param="prompt")
        if not self.prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        if isinstance(self.prompt, list) and not isinstance(self.prompt[0], int):
            empty = next((i for i, item in enumerate(self.prompt) if not item), None)
            if empty is not None:
                raise bad_request(f"prompt[{empty}] must not be empty", param="prompt")


def _publish_text_part(schema: dict[str, Any]) -> None:
    """Publish what :meth:`ChatCompletionMessageParam.text` accepts of a content part: a
    text part (validation stays wider so that the 400 says which part type is refused)."""
    schema["properties"]["type"] = {"const": "text", "type": "string"}
    schema["properties"]["text"] = {"type": "string"}
    schema["required"] = ["type", "text"]


class ContentPart(RequestModel):
    """One part of a message's ``content`` list; only ``{"type": "text", "text": ...}`` is
    supported (checked by :meth:`ChatCompletionRequest.check`; the published schema admits
    only that)."""

    model_config = ConfigDict(json_schema_extra=_publish_text_part)

    type: str
    text: str | None = None


def _publish_roles(schema: dict[str, Any]) -> None:
    """Publish the rules of :meth:`ChatCompletionMessageParam._role_fields` as one object
    schema per kind of message (``anyOf``; the roles tell them apart), as OpenAI's document
    has one per role: ``content`` required (not null) but on an assistant message,
    ``tool_call_id`` required on a tool message and null elsewhere, ``tool_calls`` null but
    on an assistant message."""
    props, null = schema.pop("properties"), {"type": "null"}
    schema.pop("required", None)
    content = {"anyOf": [s for s in props["content"]["anyOf"] if s != null]}
    call_id = next(s for s in props["tool_call_id"]["anyOf"] if s != null)

    def kind(roles: list[str], required: list[str], **narrowed: Any) -> dict[str, Any]:
        return {"type": "object", "title": f"{' or '.join(roles)} message",
                "properties": {**props, "role": {"enum": roles, "type": "string"},
                               **narrowed}, "required": ["role", *required]}

    schema["anyOf"] = [
        kind(["system", "user", "developer"], ["content"], content=content,
             tool_call_id=null, tool_calls=null),
        kind(["assistant"], [], tool_call_id=null),
        kind(["tool"], ["content", "tool_call_id"], content=content,
             tool_call_id=call_id, tool_calls=null),
    ]


class ChatCompletionMessageParam(RequestModel):
    """One message of a chat request. ``tool_calls`` (the calls an assistant made) only on
    an assistant message, ``tool_call_id`` (the call a result answers) only on, and
    required by, a tool message; every role but ``assistant`` needs ``content``. The
    published schema states these rules (one schema per kind of message).

    Raises:
        pydantic.ValidationError: a message breaking those rules (the 400 names
            ``messages[i]``), or a malformed tool call (naming its field).
    """

    model_config = ConfigDict(json_schema_extra=_publish_roles)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: ClientName | None = None
    tool_call_id: ClientName | None = None
    tool_calls: list[ToolCallParam] | None = None

    @model_validator(mode="after")
    def _role_fields(self) -> ChatCompletionMessageParam:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls is only allowed on assistant messages, not on a "
                             f"{self.role!r} message")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a 'tool' message needs tool_call_id (the id of the call it "
                             "answers)")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id is only allowed on tool messages, not on a "
                             f"{self.role!r} message")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role!r} message needs content")
        return self

    def text(self) -> str | None:
        """The content as one string: a part list's texts joined with newlines (as vLLM),
        None for no content.

        Raises:
            OpenAIError: 400 (param ``messages``) for a part that is not text.
        """
        if self.content is None or isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise bad_request(f"content parts of type {part.type!r} are not supported; "
                                  "only text parts are", param="messages")
            texts.append(part.text)
        return "\n".join(texts)

    def to_template(self) -> dict[str, Any]:
        """The message as the dict ``apply_chat_template`` takes (``role``, ``content``
        as text, and ``name`` / ``tool_call_id`` / ``tool_calls`` when given; a call's
        arguments parsed from their JSON text, as vLLM passes them to templates).

        Raises:
            OpenAIError: as :meth:`text`.
        """
        message: dict[str, Any] = {"role": self.role, "content": self.text() or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            message["tool_calls"] = [call.to_template() for call in self.tool_calls]
        return message


class ChatCompletionRequest(StructuredFields, ChatFields):
    """Body of ``POST /v1/chat/completions`` (OpenAI's, with vLLM's extras)."""

    model_config = ConfigDict(json_schema_extra=_publish_generation)

    model: ClientName | None = None
    messages: list[ChatCompletionMessageParam] = Field(json_schema_extra={"minItems": 1})
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(
        default=None, json_schema_extra=published_bounds(minimum=0, maximum=MAX_LOGPROBS))
    max_tokens: int | None = Field(default=None, description="deprecated by OpenAI")
    max_completion_tokens: int | None = None
    n: int | None = Field(default=1, json_schema_extra=_N_BOUNDS)
    presence_penalty: float | None = None
    response_format: ResponseFormat | None = None
    seed: int | None = Field(default=None, json_schema_extra=_SEED_BOUNDS)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: (Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam
                  | None) = None
    parallel_tool_calls: bool | None = True
    user: ClientName | None = None
    # vLLM's extras (``return_tokens_as_token_ids``: log-probability tokens as
    # ``token_id:<id>``)
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = 0
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    return_tokens_as_token_ids: bool | None = False
    repetition_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's chat template controls
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    prompt_logprobs: int | None = None
    echo: bool | None = False

    def max_tokens_param(self) -> tuple[int | None, str]:
        """The requested completion length and the parameter it came from:
        ``max_completion_tokens`` over the deprecated ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def check(self) -> None:
        """Reject values this server does not support.

        Raises:
            OpenAIError: 400 naming the parameter: those of the shared checks (``n``,
                ``seed``, ``stream_options``), no ``messages``, ``max_tokens`` or
                ``max_completion_tokens`` below 1 (either, as published), a non-text
                content part, ``top_logprobs`` outside ``[0, MAX_LOGPROBS]`` or above 0
                without ``logprobs``, a ``tool_choice`` that ``check_tool_request``
                refuses (no tools, an unknown name, with another constraint) or tools of
                one name, or both ``add_generation_prompt`` and
                ``continue_final_message``.
        """
        _check_common(self)
        if not self.messages:
            raise bad_request("messages must not be empty", param="messages")
        for name in ("max_tokens", "max_completion_tokens"):   # each, even when overridden
            value = getattr(self, name)
            if value is not None and value < 1:
                raise bad_request(f"{name} must be at least 1, got {name}={value}",
                                  param=name)
        for message in self.messages:
            message.text()
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                  f"top_logprobs={self.top_logprobs}", param="top_logprobs")
            if self.top_logprobs > 0 and not self.logprobs:
                raise bad_request("top_logprobs needs logprobs set to true",
                                  param="top_logprobs")
        constrained = (getattr(self, "structured_outputs", None) is not None
                       or (self.response_format is not None
                           and self.response_format.type != "text"))
        check_tool_request(self.tools, self.tool_choice, constrained)
        if self.add_generation_prompt and self.continue_final_message:
            raise bad_request("add_generation_prompt and continue_final_message cannot both "
                              "be true", param="continue_final_message")
        check_prompt_logprobs(self.prompt_logprobs, self.stream)


# ---------------------------------------------------------------------------- responses


class _VLLMExtras(BaseModel):
    """A response part with vLLM's optional extras (``prompt_token_ids``, ``token_ids``,
    ``prompt_text``): each is left out of the JSON unless it was asked for (not None)."""

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler):
        data = handler(self)
        for key in ("prompt_token_ids", "token_ids", "prompt_text"):
            if key in data and data[key] is None:
                del data[key]
        return data


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details`` (OpenAI's): ``cached_tokens``, the prompt tokens
    served from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts: each prompt counted once, completions summed over all choices;
    ``prompt_tokens_details`` with ``--enable-prompt-tokens-details`` only (left out of the
    JSON otherwise)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _drop_no_details(self, handler):
        data = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data


class CompletionLogProbs(BaseModel):
    """A completion choice's log-probabilities (OpenAI's legacy shape): per generated
    token its text, log-probability, ``{token text: logprob}`` of the most likely tokens
    (and the sampled one), and its character offset in the generated text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionResponseChoice(_VLLMExtras):
    """One choice of a completion (``prompt_logprobs``: vLLM's, when computed;
    ``prompt_token_ids`` / ``token_ids``: vLLM's, with ``return_token_ids``)."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, PromptLogprobEntry] | None] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """The body of a non-streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamChoice(_VLLMExtras):
    """One choice's piece of a streamed completion (with ``return_token_ids``: the
    prompt's ids in the choice's first chunk, the new ids in each)."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionStreamResponse(BaseModel):
    """One chunk of a streamed completion (``usage`` is sent only when asked for)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class ChatCompletionLogProb(BaseModel):
    """One candidate token: its text, log-probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    """One generated token, with the ``top_logprobs`` most likely tokens at its position."""

    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    """A chat choice's log-probabilities: one entry per generated token."""

    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessage(BaseModel):
    """The generated message of a chat choice: its text (None when the model only called
    tools), the ``tool_calls`` it made (left out of the JSON when there are none) and, with a
    ``--reasoning-parser``, its ``reasoning_content`` (vLLM's field; left out when
    None)."""

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler):
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        if data.get("reasoning_content") is None:
            data.pop("reasoning_content", None)
        return data


class ChatCompletionResponseChoice(_VLLMExtras):
    """One choice of a chat completion."""

    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_VLLMExtras):
    """The body of a non-streamed chat completion (``prompt_logprobs``: vLLM's, when
    asked for; ``prompt_token_ids``: vLLM's, with ``return_token_ids``; ``prompt_text``
    with ``return_prompt_text``)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, PromptLogprobEntry] | None] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None


class DeltaMessage(BaseModel):
    """The new part of a streamed message; unset (None) fields are left out of the JSON,
    so a chunk's delta is ``{"role": ..., "content": ...}``, ``{"content": ...}``,
    ``{"reasoning_content": ...}`` (vLLM's, with a ``--reasoning-parser``),
    ``{"tool_calls": [...]}`` (OpenAI's streamed tool call pieces) or ``{}``."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(_VLLMExtras):
    """One choice's piece of a streamed chat completion."""

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(_VLLMExtras):
    """One chunk of a streamed chat completion (``usage`` is sent only when asked for;
    ``prompt_token_ids`` and ``prompt_text``, when asked for, in the first chunk)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
