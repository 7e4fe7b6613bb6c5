"""Response bodies that encode whatever a name holds.

Python strings may hold code points UTF-8 cannot encode: lone UTF-16 surrogates
(``"\\ud800"`` from a JSON escape, ``"\\udcff"`` from an undecodable command-line byte under
``surrogateescape``). Starlette's ``JSONResponse`` renders with ``ensure_ascii=False`` and
then ``.encode("utf-8")``, which raises on them: one such adapter name would turn every
``GET /v1/models`` into a 500. Every body the server writes goes through :func:`safe_text`
first: an unencodable code point is written as its escape text (``\\ud800``, the six
characters), so the body is valid UTF-8 and valid JSON whose strings strict parsers accept
(a lone-surrogate JSON escape is refused by some, e.g. Rust's serde_json), and the name
stays recognisable.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

__all__ = ["SafeJSONResponse", "json_text", "safe_text", "safe_value"]


def safe_text(text: str) -> str:
    """``text`` with every code point UTF-8 cannot encode (lone surrogates) replaced by its
    backslash escape (``"\\ud800"`` → ``"\\\\ud800"``); ``text`` itself when it encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def safe_value(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, tuples, strings, numbers, None) with
    :func:`safe_text` applied to every string in it, keys included."""
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, dict):
        return {safe_value(k): safe_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [safe_value(v) for v in value]
    return value


def json_text(value: Any) -> str:
    """Compact JSON of ``value`` (non-ASCII kept as is) that always encodes as UTF-8.

    Raises:
        TypeError: ``value`` holds something JSON cannot represent.
        ValueError: a float in ``value`` is NaN or infinite (JSON has neither).
    """
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(safe_value(value), ensure_ascii=False, allow_nan=False,
                          separators=(",", ":"))
    return text


class SafeJSONResponse(JSONResponse):
    """Starlette's ``JSONResponse`` rendered through :func:`json_text`: a lone surrogate in
    the content is written as escape text instead of raising (a 500)."""

    def render(self, content: Any) -> bytes:
        """The body: UTF-8 bytes of ``json_text(content)``."""
        return json_text(content).encode("utf-8")
