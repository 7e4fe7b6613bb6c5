"""The serving layer's tokenization: off the event loop, and a cheap lower bound first.

* :class:`PromptTokenizer` runs every encode (and chat-template rendering) of the HTTP
  server on one worker thread, so a megabyte prompt does not freeze the event loop and
  with it every other client's stream. One thread, as vLLM's API server does: a Hugging
  Face fast tokenizer may not be used from several threads at once ("Already borrowed").
* :func:`max_token_chars` gives, once at start-up, ``L``: the most characters one token of
  the tokenizer can cover. A text of ``C`` characters then has at least ``ceil(C / L)``
  tokens, so a text that is obviously longer than the context is refused before it is
  tokenized (:meth:`PromptTokenizer.min_tokens`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

__all__ = ["PromptTokenizer", "max_token_chars"]

T = TypeVar("T")

# Pieces of a ``tokenizers`` pipeline that never drop or merge away a character of the
# input, so every character of a text lies inside some token. Anything else (a BERT
# normalizer removing control characters, a whitespace pre-tokenizer, a Replace by a
# shorter string, added tokens that absorb neighbouring whitespace, a model that maps an
# unknown run to one token) voids the bound and turns the fast check off.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Split",
                                     "Punctuation", "Sequence", "UnicodeScripts"})


def _normalizer_keeps(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_normalizer_keeps(s) for s in spec.get("normalizers", []))
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = spec.get("pattern", {})
        return ("String" in pattern
                and len(spec.get("content", "")) >= len(pattern["String"]) > 0)
    return False


def _pre_tokenizer_keeps(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind not in _KEEPING_PRE_TOKENIZERS or spec.get("behavior") == "Removed":
        return False
    return all(_pre_tokenizer_keeps(s) for s in spec.get("pretokenizers", []))


def _has_byte_level(spec: dict | None) -> bool:
    if spec is None:
        return False
    return spec.get("type") == "ByteLevel" or any(
        _has_byte_level(s) for s in spec.get("pretokenizers", []))


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters (code points) of input text one token can cover, or None when
    the tokenizer gives no such bound.

    Read from the fast tokenizer's pipeline (``backend_tokenizer``): a BPE or Unigram
    model that reaches every character (byte-level, or with byte fallback), under a
    normalizer and pre-tokenizer that keep every character (see above) and added tokens
    that do not strip whitespace. Then ``L`` is the longest vocabulary entry in
    characters: a byte-level entry has one character per byte (at least as many as the
    code points it decodes to), a SentencePiece entry one per code point, a byte-fallback
    entry (``<0x0A>``) more than the one byte it stands for, an added token its content.

    Returns:
        ``L >= 1``; None for a slow tokenizer, another pipeline, or no tokenizer.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:                    # a backend that cannot describe itself: no bound
        logger.debug("tokenizer pipeline unreadable; no token-count bound", exc_info=True)
        return None
    model = spec.get("model") or {}
    reaches_every_char = (_has_byte_level(spec.get("pre_tokenizer"))
                          or bool(model.get("byte_fallback")))
    added_keep = not any(t.get("lstrip") or t.get("rstrip")
                         for t in spec.get("added_tokens") or [])
    if not (model.get("type") in ("BPE", "Unigram") and reaches_every_char and added_keep
            and _normalizer_keeps(spec.get("normalizer"))
            and _pre_tokenizer_keeps(spec.get("pre_tokenizer"))):
        return None
    vocab = tokenizer.get_vocab()
    return max(1, max((len(token) for token in vocab), default=1))


class PromptTokenizer:
    """Encodes (and renders chat templates) on one worker thread, with a token-count
    lower bound checked before.

    Args:
        tokenizer: a Hugging Face tokenizer (``__call__(text, add_special_tokens)``), or
            None (no text prompts: ``skip_tokenizer_init``).

    Attributes:
        tokenizer: the tokenizer.
        max_chars_per_token: :func:`max_token_chars` of it (None: no bound).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.max_chars_per_token = max_token_chars(tokenizer) if tokenizer is not None else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="manylora-tokenize")

    def min_tokens(self, num_chars: int) -> int:
        """A lower bound on the tokens of a text of ``num_chars`` characters (special
        tokens not counted): ``ceil(num_chars / L)``, or 0 without a bound."""
        if self.max_chars_per_token is None:
            return 0
        return -(-num_chars // self.max_chars_per_token)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the tokenizer's worker thread (for work that uses the
        tokenizer, such as rendering a chat template and encoding the result); its
        exceptions propagate."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def encode_now(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """The token ids of each text, on the calling thread (call it through :meth:`run`
        or :meth:`encode`)."""
        return [list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
                for text in texts]

    async def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """The token ids of each text, computed on the worker thread.

        Raises:
            Exception: whatever the tokenizer raises.
        """
        return await self.run(self.encode_now, texts, add_special_tokens)
