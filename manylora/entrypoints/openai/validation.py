"""The rules every request body obeys at the edge, in one place.

* :class:`RequestModel`: the base of every request body. Types are strict, as OpenAI's API
  validates them: no string-to-bool (``"stream": "yes"``), bool-to-int (``"n": true``,
  ``"prompt": [true]``) or fraction-to-int (``"max_tokens": 5.5``) coercion, while an integer
  stays a valid number (``"temperature": 1``) and a whole number written with a fraction or
  an exponent stays a valid integer (``"max_tokens": 5.0`` is 5: JSON and JSON Schema,
  hence the published document, do not tell them apart, and vLLM's lax models take it);
  NaN and infinities are refused; unknown fields are ignored, once checked by the same
  rules as the rest (no NaN or infinity, no lone surrogate: a 400 naming the field). Every
  string anywhere in a body (dict keys and values of free-form fields included) must be
  valid Unicode, i.e. encodable as UTF-8: JSON can carry a lone UTF-16 surrogate
  (``"\\ud800"``) that no response, log line or metric label can encode, and OpenAI refuses
  such bodies with a 400.
* :func:`published_bounds`, :func:`publish_bounds`, :func:`publish_rule`: what the
  published schema of a body states beyond its types (bounds the checks enforce, rules
  between fields), validation unchanged so that the checks' 400s keep their reasons.
* :data:`ClientName`: the type of a name a client chooses that ends up as a registry key,
  a label or a log field (``model``, ``lora_name``, ``user``, a message's ``name``): on top
  of the above, no control characters (C0, DEL, C1), no line or paragraph separators, no
  bidirectional overrides, at most :data:`MAX_NAME_CHARS` characters.
* :func:`validation_error`: pydantic's errors as one OpenAI 400 whose ``param`` names the
  field (OpenAI's path form, ``messages[0].content``).

A field added later gets these rules by being declared on a ``RequestModel`` (and, for a
name, typed ``ClientName``).
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from manylora.entrypoints.openai.errors import OpenAIError

__all__ = [
    "MAX_NAME_CHARS",
    "NAME_PATTERN",
    "ClientName",
    "RequestModel",
    "check_name",
    "first_unencodable",
    "publish_bounds",
    "publish_rule",
    "published_bounds",
    "validation_error",
]

#: The longest name a client may give (``model``, ``lora_name``, ``user``, ...), characters.
MAX_NAME_CHARS = 512

# Characters a name may not hold beyond the control characters (category Cc: C0, DEL, C1)
# and surrogates (Cs): line and paragraph separators (Zl, Zp) split log lines, and the
# bidirectional embeddings, overrides and isolates reorder what a log or a listing shows.
_BAD_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")

# pydantic's tags for the members of a union in an error's location
_UNION_TAG_CHARS = frozenset("[]-,")
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def first_unencodable(text: str) -> int | None:
    """The index of the first character of ``text`` that UTF-8 cannot encode (a lone
    surrogate, U+D800 to U+DFFF), or None when there is none. O(len) in C for the usual
    text; ASCII text is answered without encoding."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _unencodable_message(text: str, index: int) -> str:
    return (f"holds a lone UTF-16 surrogate (U+{ord(text[index]):04X}) at character {index}: "
            "text must be valid Unicode (encodable as UTF-8)")


def check_name(value: str) -> str:
    """``value`` if it is a usable client-chosen name (the validator of :data:`ClientName`).

    Raises:
        ValueError: a character UTF-8 cannot encode, a control character (C0, DEL, C1), a
            line or paragraph separator, a bidirectional control, or more than
            :data:`MAX_NAME_CHARS` characters; the message says which and where (without
            echoing the character itself).
    """
    if len(value) > MAX_NAME_CHARS:
        raise ValueError(f"is {len(value)} characters long; names are at most "
                         f"{MAX_NAME_CHARS}")
    bad = first_unencodable(value)
    if bad is not None:
        raise ValueError(_unencodable_message(value, bad))
    if not value.isprintable():          # fast path: printable names pass at once
        for i, ch in enumerate(value):
            if unicodedata.category(ch) in _BAD_CATEGORIES or ch in _BIDI_CONTROLS:
                raise ValueError(f"holds the control character U+{ord(ch):04X} at character "
                                 f"{i}; names may not hold control characters")
    elif _BIDI_CONTROLS.intersection(value):
        i, ch = next((i, ch) for i, ch in enumerate(value) if ch in _BIDI_CONTROLS)
        raise ValueError(f"holds the control character U+{ord(ch):04X} at character {i}; "
                         "names may not hold control characters")
    return value


#: The rule of :func:`check_name` as a JSON-schema pattern (ECMA-262 and Python ``re``),
#: published in ``openapi.json`` so that generated clients and fuzzers know it. Lone
#: surrogates are left out: they are no Unicode text (JSON Schema's strings are sequences of
#: code points, I-JSON forbids them), every string of every body refuses them, and a
#: pattern naming them is one that regex engines of other languages (Rust's, which
#: Schemathesis validates with) cannot compile.
NAME_PATTERN = ("^[^\\u0000-\\u001f\\u007f-\\u009f\\u2028\\u2029\\u202a-\\u202e"
                "\\u2066-\\u2069]*$")

#: A name chosen by a client (see :func:`check_name`).
ClientName = Annotated[str, AfterValidator(check_name), WithJsonSchema(
    {"type": "string", "maxLength": MAX_NAME_CHARS, "pattern": NAME_PATTERN})]


def published_bounds(**keywords: Any) -> Callable[[dict[str, Any]], None]:
    """A ``json_schema_extra`` for a number field, optional or not: ``keywords``
    (``minimum``, ``maximum`` ...) on the number member of its published ``anyOf``, where
    every generator and validator reads them (beside an ``anyOf`` some take them for the
    whole union and some drop them); the field's validation is unchanged, the check that
    enforces them naming the reason."""

    def narrow(schema: dict[str, Any]) -> None:
        for member in schema.get("anyOf", [schema]):
            if member.get("type") in ("integer", "number"):
                member.update(keywords)

    return narrow


def publish_bounds(schema: dict[str, Any], bounds: Mapping[str, Mapping[str, Any]]) -> None:
    """In a model's published ``schema``, put each ``bounds[name]`` on the number member
    of property ``name`` (:func:`published_bounds`); names the model lacks are skipped."""
    props = schema.get("properties", {})
    for name, keywords in bounds.items():
        if name in props:
            published_bounds(**keywords)(props[name])


def publish_rule(schema: dict[str, Any], when: Mapping[str, Any],
                 then: Mapping[str, Any], required: bool = True,
                 otherwise: Mapping[str, Any] | None = None) -> None:
    """Add to a model's published ``schema`` a rule between its fields (JSON Schema's
    ``if``/``then``/``else``): a body whose fields ``when`` (name: schema) are all present
    and match must have its fields ``then`` (name: schema) matching, and present if
    ``required``; any other body its fields ``otherwise`` matching (when present). Each
    rule doubles the cases a generator walks: Schemathesis gives up past four."""
    rule = {"if": {"properties": dict(when), "required": list(when)},
            "then": {"properties": dict(then), **({"required": list(then)} if required
                                                  else {})}}
    if otherwise:
        rule["else"] = {"properties": dict(otherwise)}
    schema.setdefault("allOf", []).append(rule)


def _check_strings(value: Any, path: str) -> None:
    """Raise ValueError for the first string in ``value`` (nested lists, tuples, dicts and
    their keys) that UTF-8 cannot encode. Models are skipped: they checked themselves."""
    if isinstance(value, str):
        bad = first_unencodable(value)
        if bad is not None:
            where = f"item {path} " if path else ""
            raise ValueError(where + _unencodable_message(value, bad))
    elif isinstance(value, Mapping):
        for key, item in value.items():
            bad = first_unencodable(key) if isinstance(key, str) else None
            if bad is not None:
                raise ValueError(f"a key of {f'item {path}' if path else 'the object'} "
                                 + _unencodable_message(key, bad))
            _check_strings(item, f"{path}[{key!r}]")
    elif isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        if value and isinstance(value[0], int) and all(type(v) is int for v in value):
            return                       # token ids: nothing to check
        for i, item in enumerate(value):
            _check_strings(item, f"{path}[{i}]")


def _check_ignored(value: Any) -> None:
    """Raise ValueError for the first NaN or infinity, or string or key that UTF-8 cannot
    encode, in ``value`` (an unknown field's parsed JSON). Iterative: any depth the JSON
    parser took."""
    pending: list[tuple[Any, str]] = [(value, "")]
    while pending:
        item, path = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            where = f"item {path} " if path else ""
            spelled = "NaN" if math.isnan(item) else "Infinity" if item > 0 else "-Infinity"
            raise ValueError(f"{where}holds {spelled}: NaN and infinities are not JSON "
                             "numbers")
        if isinstance(item, str):
            _check_strings(item, path)
        elif isinstance(item, Mapping):
            _check_strings(dict.fromkeys(item), path)      # the keys
            pending += [(sub, f"{path}[{key!r}]") for key, sub in item.items()]
        elif isinstance(item, list):
            pending += [(sub, f"{path}[{i}]") for i, sub in enumerate(item)]


def _whole(node: Any, loc: Sequence[Any], value: float) -> Any:
    """``node`` with the float ``value`` at ``loc`` (a pydantic error's location relative to
    ``node``; union members' tags, which name no key or index, are passed over) replaced by
    the integer it equals, copying the dicts and lists on the way; ``node`` itself when
    ``loc`` leads elsewhere."""
    if not loc:
        return int(node) if type(node) is float and node == value else node
    part, rest = loc[0], loc[1:]
    if isinstance(node, dict) and isinstance(part, str) and part in node:
        new = _whole(node[part], rest, value)
        return node if new is node[part] else {**node, part: new}
    if isinstance(node, list) and type(part) is int and 0 <= part < len(node):
        new = _whole(node[part], rest, value)
        return node if new is node[part] else [*node[:part], new, *node[part + 1:]]
    return _whole(node, rest, value)


def _whole_numbers(data: Any, errors: Sequence[Mapping[str, Any]]) -> Any:
    """``data`` with every whole-number float that strict validation refused as an integer
    (``5.0`` for an ``int``) replaced by that integer; ``data`` itself when there is none."""
    fixed = data
    for error in errors:
        value = error.get("input")
        if error.get("type") == "int_type" and type(value) is float and value.is_integer():
            fixed = _whole(fixed, tuple(error.get("loc", ())), value)
    return fixed


class RequestModel(BaseModel):
    """Base of every request body: strict types (an integer is still a valid number, and a
    whole number written as ``5.0`` a valid integer, as JSON Schema's ``integer`` and
    vLLM's lax models take it), no NaN or infinity, every string valid Unicode, unknown
    fields ignored once they pass the same NaN, infinity and Unicode checks.

    Raises:
        pydantic.ValidationError: on validation, for any field breaking these rules; the
            error's location names the field (:func:`validation_error` makes it a 400).
    """

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="wrap")
    @classmethod
    def _whole_number_ints(cls, data: Any, handler: Any) -> Any:
        # strict mode refuses 5.0 for an int; only when it did, validate once more with
        # those values as the integers they are (a valid body pays nothing)
        try:
            return handler(data)
        except ValidationError as e:
            fixed = _whole_numbers(data, e.errors())
            if fixed is data:
                raise
            return handler(fixed)

    @model_validator(mode="before")
    @classmethod
    def _valid_ignored(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields)
        known.update(f.alias for f in cls.model_fields.values() if f.alias)
        for key, value in data.items():
            if key in known:
                continue
            try:
                _check_strings(key, "")
                _check_ignored(value)
            except ValueError as e:
                name = key if first_unencodable(key) is None else ascii(key)
                reason = f"an unknown field (ignored) must still be valid JSON: {e}"
                # a ValidationError raised here keeps the field's location (pydantic adds
                # the enclosing fields' for a nested model)
                raise ValidationError.from_exception_data(cls.__name__, [InitErrorDetails(
                    type=PydanticCustomError("value_error", reason), loc=(name,),
                    input=None)]) from None
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, (bool, int, float, BaseModel)):
            _check_strings(value, "")
        return value


#: pydantic's tag for a :class:`RequestModel` that is a member of a union (its wrap
#: validator's, in place of the class name).
_REQUEST_MODEL_TAG = "function-wrap[_whole_number_ints()]"


def _model_tags() -> frozenset[str]:
    """The names of every :class:`RequestModel` subclass and their union tag: pydantic's
    tags for a model that is a member of a union (a body that is one of several models, as
    ``/tokenize``'s)."""
    names, pending = {_REQUEST_MODEL_TAG}, [RequestModel]
    while pending:
        for sub in pending.pop().__subclasses__():
            names.add(sub.__name__)
            pending.append(sub)
    return frozenset(names)


def _param(loc: Sequence[Any]) -> tuple[str | None, int]:
    """OpenAI's form of a field's path (``messages[0].content``) from a pydantic location
    without its source (``body``, ``path``, ``query``), passing over a model's union tag
    (its class name) and stopping at another union member's tag; and how many parts of
    ``loc`` it took."""
    out = ""
    taken = 0
    models = _model_tags()
    for part in loc:
        if isinstance(part, str) and part in models:
            taken += 1
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part) in _UNION_TAGS or _UNION_TAG_CHARS.intersection(str(part)):
            break
        else:
            out += f".{part}" if out else str(part)
        taken += 1
    return out or None, taken


def validation_error(errors: Sequence[Mapping[str, Any]]) -> OpenAIError:
    """One 400 for pydantic's (or FastAPI's) validation errors: ``param`` is the first
    field at fault, the message says per field what is wrong, once (the failures of every
    member of a union become one line naming the accepted forms, unless one member took
    the value's type and refused its content: then that member's reason).

    Args:
        errors: ``ValidationError.errors()`` / ``RequestValidationError.errors()``; each
            location starts with its source (``body``, ``path``, ``query``).
    """
    lines: dict[str | None, list[tuple[Mapping[str, Any], int]]] = {}
    for error in errors:
        if error.get("type") == "json_invalid":
            return OpenAIError(400, "the request body is not valid JSON: "
                               f"{error.get('ctx', {}).get('error', error.get('msg'))}")
        param, taken = _param(tuple(error.get("loc", ()))[1:])
        lines.setdefault(param, []).append((error, taken))
    if not lines:
        return OpenAIError(400, "the request is not valid")
    parts = []
    for param, group in lines.items():
        # a member of a union whose type matched but whose value failed says what is wrong
        group = [g for g in group if g[0].get("type") == "value_error"][:1] or group
        messages = list(dict.fromkeys(_message(e) for e, _ in group))
        # the union member tag right after the field's own location parts
        tags = [str(e["loc"][taken + 1]).replace(_REQUEST_MODEL_TAG, "object")
                for e, taken in group if len(e["loc"]) > taken + 1]
        if len(messages) > 1 and tags:
            text = f"matches none of the accepted forms ({', '.join(dict.fromkeys(tags))})"
        else:
            text = messages[0]
        parts.append(f"{param or 'body'}: {text}")
    return OpenAIError(400, "; ".join(parts), param=next(iter(lines)))


def _message(error: Mapping[str, Any]) -> str:
    message = str(error.get("msg", "invalid value"))
    return message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
