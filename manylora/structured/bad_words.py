"""``bad_words`` (vLLM's ``SamplingParams`` field): words the output must not contain, as
token sequences. The front tokenizes each word with and without a leading space (vLLM's
``update_from_tokenizer``); before each token is sampled, the last token of a sequence is
banned when the tokens before it end the output so far (vLLM v1's ``apply_bad_words``; a
one-token sequence is always banned). The ban joins the grammar's host bitmask
(``StructuredOutputManager.fill``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["bad_words_token_ids", "banned_tokens"]


def bad_words_token_ids(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """The token sequences of ``words``: each word (its leading spaces stripped) encoded
    without special tokens, and again with one leading space when that encodes to as many
    tokens starting with another token (a word-initial variant).

    Raises:
        ValueError: a word that encodes to no token.
    """
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"bad_words entry {word!r} encodes to no token")
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def banned_tokens(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens to ban before the next one is sampled: ``seq[-1]`` of each sequence whose
    ``seq[:-1]`` is the end of ``output`` (the request's output token ids so far)."""
    banned = []
    n = len(output)
    for seq in sequences:
        k = len(seq) - 1
        if k == 0 or (n >= k and list(output[n - k:]) == list(seq[:k])):
            banned.append(seq[-1])
    return banned
