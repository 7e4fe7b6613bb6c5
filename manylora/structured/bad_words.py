"""``bad_words`` (vLLM's ``SamplingParams`` field): words the output must not contain, as
token sequences. The front tokenizes each word with and without a leading space (vLLM's
``update_from_tokenizer``); before each token is sampled, the last token of a sequence is
banned when the tokens before it end the output so far (vLLM v1's ``apply_bad_words``; a
one-token sequence is always banned). The ban joins the grammar's host bitmask
(``StructuredOutputManager.fill``), through a ``BadWords`` index built once per request,
so a step looks only at the sequences whose prefix ends with the last token sampled.

vLLM bounds neither the words nor their size; here ``check_bad_words`` bounds both
(``--max-bad-words``, ``--max-structured-output-spec-bytes``), so tokenizing them and
indexing them stay short next to a step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["DEFAULT_MAX_BAD_WORDS", "BadWords", "bad_words_token_ids", "check_bad_words",
           "clear_tokens"]

DEFAULT_MAX_BAD_WORDS = 4096


def check_bad_words(words: Sequence[str], max_words: int, max_bytes: int) -> None:
    """Bound one request's ``bad_words`` before they are tokenized.

    Args:
        words: the request's words.
        max_words: the most words (``--max-bad-words``).
        max_bytes: the most UTF-8 bytes of the words together
            (``--max-structured-output-spec-bytes``).

    Raises:
        ValueError: ``bad_words ...``, with the count or size and the bound.
    """
    if len(words) > max_words:
        raise ValueError(f"bad_words holds {len(words)} words; the server allows at most "
                         f"{max_words} (--max-bad-words)")
    size = sum(len(w.encode("utf-8", "surrogatepass")) for w in words)
    if size > max_bytes:
        raise ValueError(f"bad_words are {size} bytes together; the server allows at most "
                         f"{max_bytes} (--max-structured-output-spec-bytes)")


def bad_words_token_ids(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """The token sequences of ``words``: each word (its leading spaces stripped) encoded
    without special tokens, and again with one leading space when that encodes to as many
    tokens starting with another token (a word-initial variant). All words are encoded in
    one batch call of the tokenizer.

    Raises:
        ValueError: a word that encodes to no token.
    """
    if not words:
        return []
    stripped = [w.lstrip() for w in words]
    encoded = tokenizer(stripped + [" " + w for w in stripped],
                        add_special_tokens=False)["input_ids"]
    out: list[list[int]] = []
    for word, plain, spaced in zip(words, encoded, encoded[len(words):]):
        if not plain:
            raise ValueError(f"bad_words entry {word!r} encodes to no token")
        out.append(list(plain))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(list(spaced))
    return out


class BadWords:
    """One request's ``bad_words_token_ids`` indexed for a step: the one-token sequences
    as a bitmask row to AND (always banned), the longer ones by the last token of their
    prefix, then by the prefix, so a step costs what the last sampled token can match.

    Args:
        sequences: token sequences, each non-empty, ids below ``vocab_size``.
        vocab_size: V, the bitmask's tokens.

    Attributes:
        always: uint32 ``[ceil(V / 32)]``, the bitmask with the one-token sequences' bits
            cleared; None without one.
    """

    def __init__(self, sequences: Sequence[Sequence[int]], vocab_size: int) -> None:
        always: set[int] = set()
        after: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for seq in sequences:
            if len(seq) == 1:
                always.add(int(seq[0]))
            else:
                prefix = tuple(int(t) for t in seq[:-1])
                after.setdefault(prefix[-1], {}).setdefault(prefix, []).append(int(seq[-1]))
        self.always = None
        if always:
            self.always = np.full(-(-vocab_size // 32), 0xFFFFFFFF, dtype=np.uint32)
            clear_tokens(self.always, np.fromiter(always, dtype=np.int64, count=len(always)))
        self._after = after

    def bans(self, tokens: Sequence[int], start: int) -> list[int] | None:
        """What to ban before the next token is sampled, beyond ``always``: ``seq[-1]`` of
        each longer sequence whose ``seq[:-1]`` ends ``tokens[start:]`` (the request's
        output so far: ``tokens`` its prompt and output, ``start`` the prompt's length);
        None when nothing is banned now (no ``always`` either)."""
        n = len(tokens)
        by_prefix = self._after.get(tokens[-1]) if n > start else None
        more: list[int] = []
        for prefix, last in (by_prefix or {}).items():
            k = len(prefix)
            if n - start >= k and tuple(tokens[n - k:]) == prefix:
                more.extend(last)
        return None if not more and self.always is None else more

    def clear(self, row: np.ndarray, more: list[int]) -> None:
        """Clear the banned bits of one bitmask row (uint32 ``[ceil(V / 32)]``) in place:
        ``always``'s and ``more``'s (from ``bans``)."""
        if self.always is not None:
            row &= self.always
        clear_tokens(row, np.array(more, dtype=np.int64))


def clear_tokens(row: np.ndarray, tokens: np.ndarray) -> None:
    """Clear ``tokens``' bits in one bitmask row (uint32 ``[ceil(V / 32)]``, bit ``j % 32``
    of word ``j // 32`` for token ``j``), in place."""
    if len(tokens):
        np.bitwise_and.at(row, tokens >> 5,
                          ~np.left_shift(np.uint32(1), (tokens & 31).astype(np.uint32)))
