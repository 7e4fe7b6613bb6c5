"""``StructuredOutputsParams``: the constraint a request's output must satisfy (vLLM's
``StructuredOutputsParams``, the successor of its ``guided_*`` fields)."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

__all__ = ["StructuredOutputsParams"]

# The fields that each name one kind of constraint; exactly one of them is set.
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One output constraint, compiled by the grammar engine (xgrammar) and enforced by a
    token mask on the logits of every step (vLLM's ``StructuredOutputsParams``).

    Fields (vLLM's names; exactly one of the first six is set):
        json: a JSON schema (a dict, or its JSON text); the output is one JSON value that
            validates against it. Normalized to the schema's compact JSON text (its keys in
            their order: properties are generated in the order the schema names them), which
            is also the compile cache key.
        regex: a regular expression the whole output matches.
        choice: a non-empty list of strings; the output is one of them.
        grammar: an EBNF grammar (GBNF, as llama.cpp and xgrammar write it).
        json_object: True: the output is any JSON object (``response_format``
            ``json_object``).
        structural_tag: xgrammar's structural tag, as its JSON text.
        disable_any_whitespace: JSON without the optional whitespace between tokens.
        disable_additional_properties: a JSON schema's objects allow no properties it does
            not name (as if ``additionalProperties: false`` were set on each).

    Raises:
        ValueError: from ``__post_init__``, naming the field: none or more than one kind
            set, a ``json`` that is not an object or valid JSON text, an empty or non-string
            ``regex``/``grammar``/``structural_tag``, an empty ``choice`` or one holding a
            non-string, ``json_object`` not a bool.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(_KINDS)}; got {set_kinds or 'none'}.")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("structured_outputs.json must be a JSON schema (an object), "
                                 f"got {type(schema).__name__}.")
            self.json = _json.dumps(schema, separators=(",", ":"))
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")
        if self.choice is not None:
            if (isinstance(self.choice, str) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "strings.")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a bool.")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool.")

    @property
    def kind(self) -> str:
        """The constraint's kind: one of ``json``, ``regex``, ``choice``, ``grammar``,
        ``json_object``, ``structural_tag``."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))
