"""Reasoning parsers (vLLM's ``--reasoning-parser NAME``): split a reasoning model's
output into the ``reasoning_content`` (the text between ``<think>`` and ``</think>``) and
the ``content`` (the rest), whole or streamed. The markers reach neither field.

The rules follow vLLM's parsers of the same names:

- ``deepseek_r1``: the chat template opens the thinking, so the output is reasoning from
  its first character (a ``<think>`` the model writes itself is dropped) up to
  ``</think>``; an output without ``</think>`` (cut short) is reasoning only.
- ``qwen3``: the output is content until the model writes ``<think>``, reasoning from there
  up to ``</think>``, content after. When the rendered prompt ends inside an open
  ``<think>`` (a template that opens the thinking), the output starts as reasoning; with
  ``enable_thinking: false`` in ``chat_template_kwargs`` it is all content.

Text is split on the markers' text, not their token ids, so a marker cut across two
streamed pieces is still found: the stream holds back a tail that could begin a marker
until the next piece (or the end) tells. The streamed pieces of one output, concatenated,
are always its whole split.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

__all__ = ["REASONING_PARSERS", "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser",
           "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]

START = "<think>"
END = "</think>"


def _held_tail(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could begin one of ``markers`` (a proper
    prefix of it), so must wait for the next piece."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class ReasoningStream:
    """One choice's output split as it streams.

    Args:
        in_reasoning: the output starts as reasoning (else as content, until ``<think>``).
        drop_start: in reasoning, drop the first ``<think>`` met before ``</think>``.
        may_start: in content before any ``</think>``, a ``<think>`` opens reasoning.
    """

    def __init__(self, in_reasoning: bool, drop_start: bool, may_start: bool) -> None:
        self.in_reasoning = in_reasoning
        self.drop_start = drop_start
        self.may_start = may_start
        self.ended = False               # past </think>: content to the end
        self._held = ""

    def feed(self, text: str, finished: bool = False) -> tuple[str, str]:
        """Split the new ``text``.

        Args:
            text: the output's new piece.
            finished: the output ends with this piece (the held tail is released).

        Returns:
            ``(reasoning, content)``: the new reasoning text and the new content text
            (either may be empty).
        """
        text = self._held + text
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self.ended:
                content.append(text)
                break
            if self.in_reasoning:
                markers = (START, END) if self.drop_start else (END,)
                found = [(text.find(m), m) for m in markers if m in text]
                if found:
                    index, marker = min(found)
                    reasoning.append(text[:index])
                    text = text[index + len(marker):]
                    if marker == START:
                        self.drop_start = False
                    else:
                        self.in_reasoning = False
                        self.ended = True
                    continue
                out, channel = reasoning, markers
            elif self.may_start:
                index = text.find(START)
                if index >= 0:
                    content.append(text[:index])
                    text = text[index + len(START):]
                    self.in_reasoning, self.may_start, self.drop_start = True, False, False
                    continue
                out, channel = content, (START,)
            else:
                content.append(text)
                break
            keep = 0 if finished else _held_tail(text, channel)
            out.append(text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)


class ReasoningParser(ABC):
    """A model family's reasoning format; :meth:`stream` splits one output.

    Attributes:
        name: the name ``--reasoning-parser`` takes (vLLM's).
    """

    name: ClassVar[str]

    @abstractmethod
    def stream(self, prompt: str, chat_template_kwargs: Mapping[str, Any] | None
               ) -> ReasoningStream:
        """A splitter for one output of the rendered ``prompt`` (text), rendered with
        ``chat_template_kwargs``."""

    def split(self, text: str, prompt: str = "",
              chat_template_kwargs: Mapping[str, Any] | None = None
              ) -> tuple[str | None, str | None]:
        """A whole output's ``(reasoning_content, content)``, each None when empty (as vLLM
        returns them; an output without reasoning has ``reasoning_content`` None)."""
        reasoning, content = self.stream(prompt, chat_template_kwargs).feed(text, True)
        return reasoning or None, content or None


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek R1 (and QwQ): reasoning up to ``</think>``, the opening ``<think>``
    optional (vLLM's ``deepseek_r1``)."""

    name = "deepseek_r1"

    def stream(self, prompt: str, chat_template_kwargs: Mapping[str, Any] | None
               ) -> ReasoningStream:
        return ReasoningStream(in_reasoning=True, drop_start=True, may_start=False)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning between ``<think>`` and ``</think>``; none with
    ``enable_thinking: false`` (vLLM's ``qwen3``)."""

    name = "qwen3"

    def stream(self, prompt: str, chat_template_kwargs: Mapping[str, Any] | None
               ) -> ReasoningStream:
        if (chat_template_kwargs or {}).get("enable_thinking", True) is False:
            return ReasoningStream(in_reasoning=False, drop_start=False, may_start=False)
        opened = prompt.rfind(START) > prompt.rfind(END)
        return ReasoningStream(in_reasoning=opened, drop_start=opened, may_start=not opened)


#: The parsers ``--reasoning-parser`` takes, by vLLM's names.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser ``--reasoning-parser name`` selects.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None
