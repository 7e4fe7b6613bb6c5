"""``StructuredOutputsParams``: the constraint a request's output must satisfy (vLLM's
``StructuredOutputsParams``, the successor of its ``guided_*`` fields)."""

from __future__ import annotations

import dataclasses
import json as _json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["StructuredOutputsConfig", "StructuredOutputsParams"]

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


# vLLM's StructuredOutputsConfig keys that manylora does not take, and why.
_REFUSED_CONFIG_KEYS = {
    "reasoning_parser": "the grammar applies from the first output token; structured "
                        "output inside reasoning is not supported",
    "reasoning_parser_plugin": "the grammar applies from the first output token; structured "
                               "output inside reasoning is not supported",
    "enable_in_reasoning": "the grammar applies from the first output token; structured "
                           "output inside reasoning is not supported",
}


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """The server-wide structured-output options (vLLM's ``StructuredOutputsConfig``,
    ``--structured-outputs-config``), applied to every request's constraint.

    Fields (vLLM's names and defaults):
        backend: ``"auto"`` or ``"xgrammar"`` (the only grammar engine here; vLLM's
            others, ``guidance``, ``outlines``, ``lm-format-enforcer``, are refused).
        disable_fallback: accepted: with one backend there is nothing to fall back to.
        disable_any_whitespace: every JSON constraint (a schema, ``json_object``,
            ``response_format``, a required or named tool choice) without the optional
            whitespace between tokens, as if each request set it.
        disable_additional_properties: every JSON schema's objects allow no property the
            schema does not name, as if each request set it.
    """

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    @classmethod
    def parse(cls, value: Mapping[str, Any] | str | None) -> StructuredOutputsConfig:
        """The config of ``--structured-outputs-config``'s value: a mapping or its JSON
        text (an object); None or empty: the defaults.

        Raises:
            ValueError: not a JSON object, an unknown key (named, with the known ones),
                one of vLLM's keys manylora does not take (named, with the reason), a
                ``backend`` other than ``auto``/``xgrammar``, a non-bool option.
        """
        if value is None:
            return cls()
        if isinstance(value, str):
            try:
                value = _json.loads(value)
            except ValueError as e:
                raise ValueError(f"structured_outputs_config is not valid JSON: {e}") from None
        if not isinstance(value, Mapping):
            raise ValueError("structured_outputs_config must be a JSON object, got "
                             f"{type(value).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in value:
            if key in _REFUSED_CONFIG_KEYS:
                raise ValueError(f"structured_outputs_config.{key} is not supported: "
                                 f"{_REFUSED_CONFIG_KEYS[key]}")
            if key not in known:
                raise ValueError(f"structured_outputs_config has unknown key {key!r}; known "
                                 f"keys: {', '.join(known)}")
        config = cls(**value)
        if config.backend not in ("auto", "xgrammar"):
            raise ValueError(f"structured_outputs_config.backend {config.backend!r} is not "
                             "supported: manylora's structured outputs run on xgrammar "
                             "(use \"auto\" or \"xgrammar\")")
        for name in known[1:]:
            if not isinstance(getattr(config, name), bool):
                raise ValueError(f"structured_outputs_config.{name} must be a bool, got "
                                 f"{getattr(config, name)!r}")
        return config

    def apply(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        """``params`` with the server-wide options turned on where set (a request cannot
        turn off what the server turned on, as vLLM's backend reads the server's).
        Returns ``params`` itself when nothing changes."""
        changes = {name: True for name in ("disable_any_whitespace",
                                           "disable_additional_properties")
                   if getattr(self, name) and not getattr(params, name)}
        return dataclasses.replace(params, **changes) if changes else params
