"""Structured output in request bodies: OpenAI's ``response_format`` (``text``,
``json_object``, ``json_schema``) and vLLM's ``structured_outputs`` extra, on chat and
completions alike (vLLM accepts both on both), vLLM's ``bad_words``, and the legacy
``guided_*`` fields, which vLLM removed in 0.12 (later versions drop them silently): here
a 400 that names them and says what replaced them, never an unconstrained 200.

``structured_params`` turns a request's fields into the one ``StructuredOutputsParams`` the
engine takes; ``OpenAIServing.check_structured`` parses its grammar without a tokenizer
before the request is queued (an invalid schema, regex or grammar is a 400 naming the
field).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from manylora.entrypoints.openai.errors import bad_request
from manylora.entrypoints.openai.validation import RequestModel
from manylora.structured_params import StructuredOutputsParams

__all__ = ["JsonSchemaFormat", "LEGACY_GUIDED_FIELDS", "ResponseFormat", "StructuredFields",
           "StructuredOutputsRequest", "structured_params"]

#: vLLM's pre-0.12 guided decoding fields → their ``structured_outputs`` key.
LEGACY_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex",
                        "guided_choice": "choice", "guided_grammar": "grammar",
                        "guided_whitespace_pattern": "whitespace_pattern",
                        "guided_decoding_backend": None}


class JsonSchemaFormat(RequestModel):
    """``response_format.json_schema`` (OpenAI's): the schema the output validates
    against. ``name``, ``description`` and ``strict`` are accepted as OpenAI defines them;
    the output is always constrained to the schema (strict or not, as vLLM)."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object),
    ``json_schema`` (with ``json_schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def _publish_one_kind(schema: dict[str, Any]) -> None:
    """Publish what ``StructuredOutputsParams`` accepts: exactly one kind of constraint set
    (one schema per kind, ``anyOf``; ``json_object`` counts when true), non-empty
    ``regex``, ``grammar``, ``structural_tag`` and ``choice``, no ``whitespace_pattern``.
    Validation stays wider, so that the 400 gives the reason; what no schema states (a regex
    or grammar that does not compile, ``json`` text that is not JSON) stays with the checks.
    Options alone (no kind) beside a ``response_format`` that gives one are accepted but not
    published: they are valid only with that other field, and the document must refuse
    every body the server refuses."""
    props, null = schema["properties"], {"type": "null"}
    text = {"type": "string", "minLength": 1}
    kinds = {"json": {"anyOf": [m for m in props["json"]["anyOf"] if m != null]},
             "regex": text, "choice": {"type": "array", "items": {"type": "string"},
                                        "minItems": 1},
             "grammar": text, "json_object": {"const": True}, "structural_tag": text}
    for name, member in kinds.items():
        props[name] = {"anyOf": [{"type": "boolean"} if name == "json_object" else member,
                                 null], "default": None}
    props["whitespace_pattern"] = {**null, "default": None,
                                   "description": "not supported by xgrammar: use "
                                                  "disable_any_whitespace"}
    unset = {name: {"enum": [False, None]} if name == "json_object" else null
             for name in kinds}
    schema["anyOf"] = [{"properties": {**unset, name: member}, "required": [name]}
                       for name, member in kinds.items()]


class StructuredOutputsRequest(RequestModel):
    """vLLM's ``structured_outputs`` extra: exactly one of ``json`` (a schema, an object or
    its JSON text), ``regex``, ``choice``, ``grammar`` (EBNF), ``json_object``,
    ``structural_tag`` (xgrammar's, as JSON text), or none of them beside a
    ``response_format`` that gives the kind (as vLLM fills the request's
    ``structured_outputs`` from it); ``disable_any_whitespace``,
    ``disable_additional_properties``, and ``disable_fallback`` (accepted: xgrammar is the
    only backend, there is nothing to fall back to). ``whitespace_pattern`` is a 400: it is
    not an xgrammar option. The published schema states these rules."""

    model_config = ConfigDict(json_schema_extra=_publish_one_kind)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None


class StructuredFields(RequestModel):
    """The structured-output fields of ``/v1/completions`` and ``/v1/chat/completions``
    (a base of both request bodies), vLLM's ``bad_words`` (banned through the same host
    mask), and the refusal of vLLM's removed ``guided_*``."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    bad_words: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_legacy_guided(cls, data: Any) -> Any:
        """Raises ``OpenAIError`` (400 naming the field; pydantic lets it through) for a
        non-null ``guided_*`` field."""
        if isinstance(data, dict):
            for name, key in LEGACY_GUIDED_FIELDS.items():
                if data.get(name) is not None:
                    instead = (f'use "structured_outputs": {{"{key}": ...}}' if key
                               else "xgrammar is the only backend")
                    raise bad_request(f"{name} was removed by vLLM 0.12 and is not "
                                      f"supported; {instead}", param=name)
        return data


def structured_params(request: StructuredFields) -> tuple[StructuredOutputsParams | None,
                                                           str | None]:
    """The request's output constraint and the parameter it came from
    (``structured_outputs`` or ``response_format``); ``(None, None)`` without one.

    A ``structured_outputs`` that sets no kind beside a ``response_format`` that gives one
    lends it its options (``disable_any_whitespace``, ``disable_additional_properties``),
    as vLLM fills the request's ``structured_outputs`` from its ``response_format``.

    Raises:
        OpenAIError: 400 naming the parameter: both set a kind, a ``json_schema`` response
            format without its ``json_schema.schema``, ``whitespace_pattern``, or fields
            that ``StructuredOutputsParams`` refuses (none or several kinds, a bad
            ``json``).
    """
    so, fmt = request.structured_outputs, request.response_format
    constrained_fmt = fmt is not None and fmt.type != "text"
    options: dict[str, Any] = {}
    if so is not None:
        if so.whitespace_pattern is not None:
            raise bad_request("structured_outputs.whitespace_pattern is not supported by the "
                              "xgrammar backend; use disable_any_whitespace",
                              param="structured_outputs.whitespace_pattern")
        fields = so.model_dump(by_alias=True,
                               exclude={"disable_fallback", "whitespace_pattern"})
        options = {k: fields.pop(k) for k in ("disable_any_whitespace",
                                              "disable_additional_properties")}
        has_kind = any(v not in (None, False) for v in fields.values())
        if has_kind and constrained_fmt:
            raise bad_request("set either structured_outputs or a response_format other "
                              "than text, not both (structured_outputs may carry options "
                              "alone beside a response_format)", param="structured_outputs")
        if not constrained_fmt:
            return _params("structured_outputs", **fields, **options), "structured_outputs"
    if not constrained_fmt:
        return None, None
    if fmt.type == "json_object":
        return _params("response_format", json_object=True, **options), "response_format"
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_request("response_format json_schema needs json_schema.schema",
                          param="response_format.json_schema")
    return (_params("response_format", json=fmt.json_schema.schema_, **options),
            "response_format")


def _params(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise bad_request(str(e), param=param) from None
