"""One ``StructuredOutputsParams`` as an xgrammar grammar: its cache key, the tokenizer-free
check the front runs before queueing a request, and the compile call the core's compiler
thread makes (vLLM's xgrammar backend: JSON schemas in strict mode, ``json_object`` as the
schema ``{"type": "object"}``, ``choice`` as an EBNF alternation of string literals)."""

from __future__ import annotations

import functools
from typing import Any

from manylora.structured_params import StructuredOutputsParams

__all__ = ["DEFAULT_MAX_SPEC_BYTES", "GrammarKey", "check_spec_size",
           "check_structured_outputs", "compile_grammar", "grammar_key"]

#: ``--max-structured-output-spec-bytes``: about OpenAI's bound on a structured-output
#: schema's text (120,000 characters of names, enum and const values).
DEFAULT_MAX_SPEC_BYTES = 128 * 2**10

#: (kind, spec, disable_any_whitespace): what a compiled grammar is cached under.
GrammarKey = tuple[str, str, bool]

_OBJECT_SCHEMA = '{"type": "object"}'


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    """The compile cache key of ``params``: its kind, its spec as text (a JSON schema is
    already normalized to sorted-key JSON by ``StructuredOutputsParams``; ``choice`` is its
    EBNF) and whether whitespace is free.

    ``disable_additional_properties`` is not part of it: xgrammar compiles every schema in
    strict mode, where objects allow no property the schema does not name (vLLM's xgrammar
    backend does the same)."""
    kind = params.kind
    if kind == "choice":
        spec = choice_ebnf(params.choice)
    elif kind == "json_object":
        spec = _OBJECT_SCHEMA
    else:
        spec = getattr(params, kind)
    return kind, spec, not params.disable_any_whitespace


def choice_ebnf(choices: list[str]) -> str:
    """``root ::= "c1" | "c2" | ...``: the output is exactly one of ``choices`` (each
    literal escaped for EBNF: backslash, double quote, and control characters as
    ``\\n``, ``\\r``, ``\\t`` or ``\\xHH``)."""
    return "root ::= " + " | ".join(f'"{_ebnf_escape(c)}"' for c in choices)


def _ebnf_escape(text: str) -> str:
    out = []
    for ch in text:
        if ch in '\\"':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def check_spec_size(params: StructuredOutputsParams, max_bytes: int) -> None:
    """Bound the size of ``params``' grammar before it is parsed or compiled (the text
    ``grammar_key`` gives: a schema as compact JSON, ``choice`` as its EBNF).

    Raises:
        ValueError: ``structured_outputs.<kind> is N bytes; ...`` over ``max_bytes``
            (``--max-structured-output-spec-bytes``).
    """
    kind, spec, _ = grammar_key(params)
    size = len(spec.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        what = " as a grammar" if kind == "choice" else ""
        raise ValueError(f"structured_outputs.{kind} is {size} bytes{what}; the server "
                         f"allows at most {max_bytes} (--max-structured-output-spec-bytes)")


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """Parse ``params``' grammar without a tokenizer (xgrammar's ``Grammar.from_*``), so a
    bad schema, regex or grammar is refused before the request is queued. Takes
    microseconds to milliseconds per grammar (a spec that parsed is remembered: the last
    1,024): run it off the event loop.

    Raises:
        ValueError: ``structured_outputs.<kind>: <what xgrammar found>`` (an unsupported or
            malformed JSON schema, a regex that does not parse, an EBNF grammar with an
            undefined rule, an invalid structural tag).
    """
    _check_key(grammar_key(params))


@functools.lru_cache(maxsize=1024)
def _check_key(key: GrammarKey) -> None:
    import xgrammar as xgr

    kind, spec, any_ws = key
    try:
        if kind in ("json", "json_object"):
            xgr.Grammar.from_json_schema(spec, any_whitespace=any_ws)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind in ("grammar", "choice"):
            xgr.Grammar.from_ebnf(spec)
        else:
            xgr.Grammar.from_structural_tag(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs.{kind}: {_message(e)}") from None


def compile_grammar(compiler: Any, key: GrammarKey) -> Any:
    """Compile ``key``'s grammar with an ``xgrammar.GrammarCompiler`` → ``CompiledGrammar``.

    Raises:
        ValueError: ``structured_outputs.<kind>: <what xgrammar found>``.
    """
    kind, spec, any_ws = key
    try:
        if kind in ("json", "json_object"):
            return compiler.compile_json_schema(spec, any_whitespace=any_ws)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind in ("grammar", "choice"):
            return compiler.compile_grammar(spec)
        return compiler.compile_structural_tag(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs.{kind}: {_message(e)}") from None


def _message(error: Exception) -> str:
    """xgrammar's message without its C++ prefix (``[time] /project/cpp/file.cc:N: ``)."""
    text = str(error).strip()
    if text.startswith("[") and ".cc:" in text:
        text = text.split(".cc:", 1)[1].split(": ", 1)[-1]
    return text.splitlines()[0] if text else type(error).__name__
