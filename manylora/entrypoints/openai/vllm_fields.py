"""Every field vLLM's ``CompletionRequest`` and ``ChatCompletionRequest`` declare, and what
this server does with it: honours it, or refuses a value other than its default with a 400
naming it. Unknown fields (declared by neither) are accepted and logged as ignored, as
vLLM's ``OpenAIBaseModel`` does.

* :data:`FIELDS`: the table, one :class:`FieldRule` per field name (the routes it exists
  on, ``honoured`` / ``refused`` / ``inert``, and why). ``inert`` fields are those vLLM
  itself declares without any effect on a generation endpoint (``user``,
  ``return_token_offsets`` ...): accepted, with nothing to change. Fields other tasks of
  issue 19 build (prompt log-probabilities, structured output, tools) are not declared here.
* :class:`CompletionFields`, :class:`ChatFields`: the request bodies' bases, declaring the
  vLLM extras this module owns; :func:`check_fields` refuses the ``refused`` ones set to a
  non-default value (and the per-request chat template without
  ``--trust-request-chat-template``).
* :func:`truncate_prompt`: ``truncate_prompt_tokens`` with vLLM's semantics.
* OpenAI fields vLLM does not declare: those whose value could change the output here
  (``functions``, ``function_call``, ``audio``, ``modalities`` beyond text,
  ``web_search_options``) are refused (:data:`REFUSED_OPENAI_FIELDS`); the rest
  (``store``, ``metadata``, ``service_tier``, ``prediction``, ``verbosity``,
  ``prompt_cache_key``, ``safety_identifier`` ...) are logged as ignored like any unknown
  field, as vLLM does.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from manylora.entrypoints.openai.errors import bad_request
from manylora.entrypoints.openai.validation import ClientName, RequestModel
from manylora.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)

__all__ = [
    "FIELDS",
    "REFUSED_OPENAI_FIELDS",
    "ChatFields",
    "CompletionFields",
    "FieldRule",
    "check_fields",
    "ignored_fields",
    "response_ids",
    "truncate_prompt",
]

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

Route = Literal["completion", "chat"]
_BOTH: frozenset[str] = frozenset({"completion", "chat"})
_CHAT: frozenset[str] = frozenset({"chat"})
_COMPLETION: frozenset[str] = frozenset({"completion"})


@dataclass(frozen=True)
class FieldRule:
    """What the server does with one request field.

    Attributes:
        status: ``honoured`` (its value reaches the engine or the response), ``refused``
            (a 400 naming it for any value but ``unset``), or ``inert`` (vLLM declares it
            without effect on a generation route; accepted).
        routes: ``completion``, ``chat`` or both.
        why: for ``refused`` and ``inert``, the reason (the 400's message says it).
        unset: the values that mean "not asked for" (accepted for a refused field).
    """

    status: Literal["honoured", "refused", "inert"]
    routes: frozenset[str] = _BOTH
    why: str = ""
    unset: tuple[Any, ...] = (None,)


def _h(routes: frozenset[str] = _BOTH) -> FieldRule:
    return FieldRule("honoured", routes)


def _r(why: str, *unset: Any, routes: frozenset[str] = _BOTH) -> FieldRule:
    return FieldRule("refused", routes, why, (None, *unset))


_NO_BEAM = "beam search is not served"
_NO_MM = "this server serves text models only"
_NO_DISAGG = "disaggregated prefill/encode is not served"

#: Every field of vLLM's two request bodies this module knows, by name.
FIELDS: dict[str, FieldRule] = {
    # OpenAI's
    "model": _h(), "prompt": _h(_COMPLETION), "messages": _h(_CHAT), "echo": _h(),
    "frequency_penalty": _h(), "logit_bias": _h(), "logprobs": _h(), "max_tokens": _h(),
    "max_completion_tokens": _h(_CHAT), "top_logprobs": _h(_CHAT), "n": _h(),
    "presence_penalty": _h(), "seed": _h(), "stop": _h(), "stream": _h(),
    "stream_options": _h(), "temperature": _h(), "top_p": _h(),
    "best_of": _r("best_of above n is not served (vLLM v1 does not serve it either)",
                  routes=_COMPLETION),
    "suffix": _r("suffix (fill-in-the-middle) is not served", routes=_COMPLETION),
    "user": FieldRule("inert", why="an end-user id for the client's own records"),
    "reasoning_effort": _h(_CHAT),
    # vLLM's sampling extras
    "use_beam_search": _r(_NO_BEAM, False), "length_penalty": _r(_NO_BEAM, 1.0),
    "watermarking": _r("watermarking is not built", False),
    "top_k": _h(), "min_p": _h(), "repetition_penalty": _h(), "stop_token_ids": _h(),
    "include_stop_str_in_output": _h(), "ignore_eos": _h(), "min_tokens": _h(),
    "skip_special_tokens": _h(), "spaces_between_special_tokens": _h(),
    "truncate_prompt_tokens": _h(), "truncation_side": _h(), "allowed_token_ids": _h(),
    "logprob_token_ids": _r("log-probabilities of chosen token ids are not built"),
    # vLLM's other extras
    "prompt_embeds": _r("prompt embeddings are not served", routes=_COMPLETION),
    "add_special_tokens": _h(), "priority": _r("priority scheduling is not served", 0),
    "request_id": _h(),
    "session_id": FieldRule("inert", why="vLLM's routing identity, no effect on the output"),
    "return_tokens_as_token_ids": _h(), "return_token_ids": _h(),
    "return_prompt_text": _h(_CHAT),
    "routed_experts_prompt_start": FieldRule("inert", why="no mixture-of-experts model"),
    "return_token_offsets": FieldRule(
        "inert", why="used by vLLM's /render routes only, ignored on generation routes"),
    "return_mm_kwargs": FieldRule(
        "inert", why="used by vLLM's /render routes only, ignored on generation routes"),
    "cache_salt": _h(),
    "kv_transfer_params": _r(_NO_DISAGG), "ec_transfer_params": _r(_NO_DISAGG),
    "vllm_xargs": _r("there are no custom extensions to pass arguments to"),
    "repetition_detection": _r("repetition detection is not built"),
    "thinking_token_budget": _r("thinking token budgets are not built", -1),
    "stream_interval": _r("streams send every token as it comes (interval 1)", 1),
    "include_reasoning": FieldRule(
        "inert", _CHAT, "false drops reasoning_content; without --reasoning-parser there is "
        "none to drop"),
    "add_generation_prompt": _h(_CHAT), "continue_final_message": _h(_CHAT),
    "documents": _h(_CHAT), "chat_template": _h(_CHAT), "chat_template_kwargs": _h(_CHAT),
    "media_io_kwargs": _r(_NO_MM, routes=_CHAT),
    "mm_processor_kwargs": _r(_NO_MM, routes=_CHAT),
}

#: OpenAI fields vLLM does not declare whose value could change the output here: a 400
#: naming them, with the reason, unless null (or, for ``modalities``, text alone).
REFUSED_OPENAI_FIELDS: dict[str, str] = {
    "functions": "the deprecated 'functions' are not served: use 'tools'",
    "function_call": "the deprecated 'function_call' is not served: use 'tool_choice'",
    "audio": "audio output is not served",
    "modalities": "only the 'text' modality is served",
    "web_search_options": "web search is not served",
}


def ignored_fields(model: type[RequestModel], data: Any) -> list[str]:
    """The top-level keys of the body ``data`` that ``model`` does not declare."""
    if not isinstance(data, dict):
        return []
    return [k for k in data if k not in model.model_fields]


def _types(schema: dict[str, Any]) -> set[str]:
    """The JSON types a (pydantic-generated) property schema admits."""
    found = {schema["type"]} if isinstance(schema.get("type"), str) else set()
    for option in schema.get("anyOf", ()):
        found |= _types(option)
    return found


def _publish_refusals(schema: dict[str, Any], model: type) -> None:
    """Narrow the published schema of each ``refused`` field to what is accepted (null,
    its unset values, an empty object or array), the reason in its description, and say
    that other fields are accepted (``additionalProperties``, ignored with a log): the
    document says what the server enforces (``openapi.py``), while validation stays
    permissive so that :func:`check_fields` answers with the reason."""
    schema["additionalProperties"] = True      # unknown fields: accepted, logged, ignored
    props = schema.get("properties", {})
    for name, rule in FIELDS.items():
        if rule.status != "refused" or name == "best_of" or name not in props:
            continue
        types = _types(props[name])
        options: list[dict[str, Any]] = [{"type": "null"}]
        options += [{"const": u} for u in rule.unset if u is not None]
        if "object" in types:
            options.append({"type": "object", "maxProperties": 0})
        if "array" in types:
            options.append({"type": "array", "maxItems": 0})
        props[name] = {"anyOf": options, "description": f"not supported: {rule.why}",
                       **({"default": props[name]["default"]} if "default" in props[name]
                          else {})}


class _VLLMRequest(RequestModel):
    """Base of the two generation bodies: unknown top-level fields are logged as ignored
    (vLLM's message), and the refused OpenAI fields are kept (``model_extra`` stays
    unused) so that :func:`check_fields` can name them. The published schema of a
    refused field admits only its unset values (:func:`_publish_refusals`)."""

    model_config = ConfigDict(json_schema_extra=_publish_refusals)

    _refused_openai: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _log_ignored(cls, data: Any, handler: Any) -> Any:
        result = handler(data)
        extra = ignored_fields(cls, data)
        result._refused_openai = {k: data[k] for k in extra if k in REFUSED_OPENAI_FIELDS}
        logged = [k for k in extra if k not in REFUSED_OPENAI_FIELDS]
        if logged:
            logger.warning("The following fields were present in the request but ignored: "
                           "%s", ascii(sorted(logged)[:20]))
        return result


class _SharedFields(_VLLMRequest):
    """The vLLM extras both generation routes declare (see :data:`FIELDS`)."""

    use_beam_search: bool | None = False
    length_penalty: float | None = 1.0
    watermarking: bool | None = None
    spaces_between_special_tokens: bool | None = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = Field(
        default=None, description="keep only this many prompt tokens (-1: the context "
        "length); the side is truncation_side")
    truncation_side: Literal["left", "right"] | None = Field(
        default=None, description="'left' (default) keeps the last tokens, 'right' the first")
    logprob_token_ids: list[int] | None = None
    priority: int | None = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)
    session_id: ClientName | None = None
    return_token_ids: bool | None = Field(
        default=None, description="add prompt_token_ids and token_ids to each choice")
    routed_experts_prompt_start: int | None = Field(default=0, ge=0)
    return_token_offsets: bool | None = False
    return_mm_kwargs: bool | None = True
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=1024,
        description="salts the prefix cache: only requests with the same salt share "
                    "cached blocks")
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None


class CompletionFields(_SharedFields):
    """The vLLM extras of ``/v1/completions`` this module owns (see :data:`FIELDS`)."""

    prompt_embeds: str | list[str] | None = Field(
        default=None, description="base64 prompt embeddings (vLLM's); refused")
    add_special_tokens: bool | None = Field(
        default=True, description="add the tokenizer's special tokens (e.g. BOS) to a text "
        "prompt")
    request_id: ClientName | None = Field(
        default=None, description="the response's id is 'cmpl-<request_id>'")


class ChatFields(_SharedFields):
    """The vLLM extras of ``/v1/chat/completions`` this module owns (see :data:`FIELDS`)."""

    add_special_tokens: bool | None = Field(
        default=False, description="add the tokenizer's special tokens on top of what the "
        "chat template renders")
    request_id: ClientName | None = Field(
        default=None, description="the response's id is 'chatcmpl-<request_id>'")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh",
                              "max"] | None = None
    include_reasoning: bool | None = True
    documents: list[dict[str, str]] | None = Field(
        default=None, description="passed to the chat template (retrieval-augmented "
        "templates)")
    chat_template: str | None = Field(
        default=None, description="a Jinja chat template for this request; refused unless "
        "the server runs with --trust-request-chat-template")
    echo: bool | None = Field(
        default=False, description="when the last message is the assistant's, the reply "
        "starts with its content")
    return_prompt_text: bool | None = Field(
        default=None, description="add the rendered prompt (prompt_text) to the response")
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


def _unset(value: Any, rule: FieldRule) -> bool:
    """Whether ``value`` is one of ``rule.unset`` (a bool only equal to a bool), or empty."""
    for u in rule.unset:
        if value is u or (not isinstance(value, bool) and not isinstance(u, bool)
                          and value == u):
            return True
    return isinstance(value, (dict, list, bytes)) and not value


def check_fields(request: CompletionFields | ChatFields, route: Route,
                 trust_request_chat_template: bool = False,
                 max_logprobs: int = MAX_LOGPROBS) -> None:
    """Refuse what :data:`FIELDS` and :data:`REFUSED_OPENAI_FIELDS` refuse, a
    per-request chat template (``chat_template``, or ``chat_template`` inside
    ``chat_template_kwargs``) unless the server trusts them, as vLLM does, and more
    log-probabilities per token than ``max_logprobs`` (``--max-logprobs``).

    Raises:
        OpenAIError: 400 whose ``param`` names the field, with the reason.
    """
    param = "logprobs" if route == "completion" else "top_logprobs"
    asked = getattr(request, param, None)
    if isinstance(asked, int) and not isinstance(asked, bool) and asked > max_logprobs:
        raise bad_request(f"{param} must be at most {max_logprobs} (--max-logprobs), got "
                          f"{param}={asked}", param=param)
    for name, rule in FIELDS.items():
        if rule.status != "refused" or route not in rule.routes:
            continue
        value = getattr(request, name, None)
        if name == "best_of" or _unset(value, rule):
            continue
        raise bad_request(f"{name} is not supported: {rule.why} (got {name}={value!r:.80})",
                          param=name)
    for name, value in getattr(request, "_refused_openai", {}).items():
        if value is None or (name == "modalities" and value in (["text"], [])):
            continue
        raise bad_request(f"{name} is not supported: {REFUSED_OPENAI_FIELDS[name]}",
                          param=name)
    if route == "chat" and not trust_request_chat_template:
        kwargs = getattr(request, "chat_template_kwargs", None) or {}
        param = ("chat_template" if getattr(request, "chat_template", None) is not None
                 else "chat_template_kwargs" if "chat_template" in kwargs else None)
        if param is not None:
            raise bad_request("a chat template was passed with the request, but the server "
                              "runs without --trust-request-chat-template: refused",
                              param=param)


def truncate_prompt(token_ids: list[int], truncate: int | None, side: str | None,
                    max_model_len: int) -> list[int]:
    """``token_ids`` cut to ``truncate`` tokens, as vLLM's ``truncate_prompt_tokens``.

    Args:
        token_ids: the prompt's ids.
        truncate: None (no truncation), ``k >= 1`` (keep ``k`` tokens) or -1 (keep
            ``max_model_len`` tokens).
        side: ``"left"`` or None (keep the last ``k``) or ``"right"`` (keep the first).
        max_model_len: the context length, tokens.

    Raises:
        OpenAIError: 400 (``truncate_prompt_tokens``) when ``truncate`` is 0 (no prompt
            would be left; vLLM fails on the empty prompt) or exceeds ``max_model_len``.
    """
    if truncate is None:
        return token_ids
    if truncate == 0:
        raise bad_request("truncate_prompt_tokens must be -1 or at least 1: 0 would leave no "
                          "prompt", param="truncate_prompt_tokens")
    if truncate > max_model_len:
        raise bad_request(f"truncate_prompt_tokens ({truncate}) is greater than the context "
                          f"length (max_model_len {max_model_len}); use -1 for the context "
                          "length", param="truncate_prompt_tokens")
    keep = max_model_len if truncate == -1 else truncate
    if len(token_ids) <= keep:
        return token_ids
    if side == "right":
        return token_ids[:keep]
    return token_ids[len(token_ids) - keep:] if keep else []


def response_ids(prefix: str, request_id: str | None) -> tuple[str, str]:
    """The response's id and the prefix of its engine requests' ids.

    Without ``request_id``: ``<prefix>-<32 hex digits>`` for both. With it (vLLM's
    ``request_id``): the response's id is ``<prefix>-<request_id>``, and its engine requests
    add 8 random hex digits so that two HTTP requests with the same ``request_id`` do not
    collide in the engine.
    """
    if request_id is None:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        return rid, rid
    rid = f"{prefix}-{request_id}"
    return rid, f"{rid}-{uuid.uuid4().hex[:8]}"
