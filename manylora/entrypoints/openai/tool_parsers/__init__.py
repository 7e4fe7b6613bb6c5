"""Tool call parsers (vLLM's ``--tool-call-parser NAME``): each reads one model family's
tool call format out of generated text, whole (``extract_tool_calls``) or streamed
(``streaming()``). ``base.py`` holds the scanner they share; one module per format."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from manylora.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    StreamingToolExtractor,
    ToolDelta,
    ToolParser,
)
from manylora.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from manylora.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from manylora.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from manylora.entrypoints.openai.tool_parsers.required import RequiredToolCallsParser

__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "RequiredToolCallsParser",
    "StreamingToolExtractor",
    "ToolDelta",
    "ToolParser",
    "get_tool_parser",
    "import_tool_parser_plugin",
    "register_tool_parser",
]

#: The formats ``--tool-call-parser`` takes, by vLLM's names.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser ``--tool-call-parser name`` selects.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None


def register_tool_parser(*names: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """A class decorator that makes a :class:`ToolParser` subclass ``--tool-call-parser``'s
    under ``names`` (default: its ``name``), as vLLM's
    ``ToolParserManager.register_module`` does for its plugins. A name taken before is
    replaced.

    Raises:
        TypeError: the class is not a ``ToolParser``.
    """
    def register(cls: type[ToolParser]) -> type[ToolParser]:
        if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
            raise TypeError(f"{cls!r} is not a ToolParser subclass")
        for name in names or (cls.name,):
            TOOL_PARSERS[name] = cls
        return cls
    return register


def import_tool_parser_plugin(path: str) -> None:
    """Import the Python file ``path`` as a module named after it, as vLLM's
    ``--tool-parser-plugin`` does (``ToolParserManager.import_tool_parser``); the file
    registers its parsers with :func:`register_tool_parser`. The parsers implement this
    package's :class:`ToolParser` (vLLM's plugin classes do not run here).

    Raises:
        ValueError: no such file, or the import failed (the error named).
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--tool-parser-plugin {path}: no such file")
    name = file.stem
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"--tool-parser-plugin {path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"--tool-parser-plugin {path}: importing it failed: "
                         f"{type(e).__name__}: {e}") from e
