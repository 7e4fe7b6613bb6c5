"""Incremental detokenization and stop-string matching for streamed generation.

Follows the offset-window approach of vLLM / Hugging Face TGI: each new token decodes a
short window of tokens, so a step costs O(window), not O(length of the output).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["IncrementalDetokenizer", "check_stop_strings"]

# How many prompt tokens the first window reaches back (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): gives the first output token its context so
# that leading-space handling (sentencepiece "▁", byte-level "Ġ") decodes as in the full text.
_PROMPT_CONTEXT_TOKENS = 5

# Drop already-emitted ids from the working list once this many pile up before the window.
_TRIM_AT = 256

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turn generated token ids into text, one token at a time.

    Keeps ``prefix_offset <= read_offset`` into a working list of ids (the last few prompt
    ids followed by the output ids). On each :meth:`append`, it decodes
    ``ids[prefix_offset:]`` and ``ids[prefix_offset:read_offset]``; the new text is the part
    of the first past the second. While the decoded window ends in U+FFFD (an incomplete
    UTF-8 byte sequence, e.g. the first byte token of "é" or of an emoji) nothing is emitted
    and the offsets stay, so the character comes out whole once its last byte arrives.

    Invariant (byte-level BPE, no leading-space stripping in the decoder): after appending
    ``ids``, ``text == tokenizer.decode(ids, skip_special_tokens=...)`` whenever that
    decoded text does not end in U+FFFD; after :meth:`flush` it holds always. For decoders
    that strip the leading space of a sequence (sentencepiece), ``text`` keeps the space the
    first output token has after the prompt, as in vLLM. Tokenization-space clean-up is not
    applied (``clean_up_tokenization_spaces=False``). A token added with :meth:`skip` (the
    stop token that ended the sequence) counts in ``token_ids`` but is left out of the
    decoded ids, so it never reaches ``text``.

    Args:
        tokenizer: a ``transformers`` ``PreTrainedTokenizerBase`` (fast or slow).
        prompt_token_ids: the prompt's ids; only its last few are used, as context.
        skip_special_tokens: leave special tokens (e.g. ``</s>``) out of the text.
        spaces_between_special_tokens: put spaces between special tokens kept in the text
            (Hugging Face's option: slow tokenizers honour it, fast ones decode alike
            either way, as vLLM's fast detokenizer).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = bool(skip_special_tokens)
        # passed only when off: the default decode call stays the plain one
        self._options = ({} if spaces_between_special_tokens
                         else {"spaces_between_special_tokens": False})
        context = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]]
        # Working ids: prompt context + output ids not yet trimmed away.
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._output_ids: list[int] = []
        self._chunks: list[str] = []
        self._joined_text: str | None = ""
        # Decoded ids[prefix_offset:read_offset], recomputed only when the offsets move.
        self._prefix_text = self._decode(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        """Decode ``ids`` with this detokenizer's options (no space clean-up)."""
        if not ids:
            return ""
        return self.tokenizer.decode(
            list(ids),
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
            **self._options,
        )

    def append(self, token_id: int) -> str:
        """Add one generated token and return the text it completes.

        Args:
            token_id: the new token's id.

        Returns:
            The new text (possibly several characters, e.g. a held-back multi-byte character
            plus this token's text), or ``""`` while the decoded window ends in U+FFFD
            (incomplete UTF-8 sequence) or the token adds no text (a skipped special token).
        """
        token_id = int(token_id)
        self._output_ids.append(token_id)
        self._ids.append(token_id)
        window = self._ids[self._prefix_offset :]
        full = self._decode(window)
        if len(full) <= len(self._prefix_text) or full.endswith(_REPLACEMENT_CHAR):
            return ""
        new_text = full[len(self._prefix_text) :]
        # The emitted window becomes the next prefix: ids[read_offset:] decodes to new_text.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._chunks.append(new_text)
        self._joined_text = None
        return new_text

    def skip(self, token_id: int) -> None:
        """Add the token that ended the sequence (an EOS or a ``stop_token_ids`` hit)
        without its text, whatever ``skip_special_tokens`` says: vLLM's detokenizer leaves
        the stop token out of the text it decodes (it stays in ``token_ids``). Call at most
        once, as the last token, before :meth:`flush`.

        Args:
            token_id: the stop token's id.
        """
        self._output_ids.append(int(token_id))

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete UTF-8 tail decodes to U+FFFD).

        Call once when the sequence ends; afterwards ``text`` equals
        ``tokenizer.decode(token_ids, skip_special_tokens=...)`` (byte-level tokenizers),
        a token added with :meth:`skip` left out.

        Returns:
            The text emitted now, usually ``""``.
        """
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(self._prefix_text):
            return ""
        new_text = full[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._chunks.append(new_text)
        self._joined_text = None
        return new_text

    @property
    def text(self) -> str:
        """All output text emitted so far (the concatenation of :meth:`append` results)."""
        if self._joined_text is None:
            self._joined_text = "".join(self._chunks)
            self._chunks = [self._joined_text]
        return self._joined_text

    @property
    def token_ids(self) -> list[int]:
        """The output token ids appended so far (a copy; prompt ids excluded)."""
        return list(self._output_ids)

    @property
    def num_tokens(self) -> int:
        """How many output tokens were appended."""
        return len(self._output_ids)


def check_stop_strings(
    text: str,
    new_text_len: int,
    stop: Sequence[str],
    include_stop_str_in_output: bool,
) -> tuple[str, int] | None:
    """Find a stop string that the newest characters of ``text`` completed (as vLLM).

    Only matches that overlap the last ``new_text_len`` characters are searched for (older
    text was checked on earlier steps): for each stop string ``s`` the search starts at
    ``len(text) - new_text_len - len(s) + 1`` (never below 0). When several stop strings
    match, the one that starts first in ``text`` wins (ties: the earlier one in ``stop``).

    Args:
        text: all output text so far, including the newest characters.
        new_text_len: how many characters at the end of ``text`` are new this step.
        stop: the stop strings (non-empty).
        include_stop_str_in_output: keep the stop string in the returned text.

    Returns:
        None when no stop string matched; else ``(truncated_text, index)`` where
        ``truncated_text`` is ``text`` cut right before the matched stop string (or right
        after it with ``include_stop_str_in_output``; any text after the match is dropped)
        and ``index`` is the position in ``stop`` of the string that matched.
    """
    if new_text_len <= 0 or not stop:
        return None
    best_pos = -1
    best_idx = -1
    for idx, s in enumerate(stop):
        if not s:
            continue
        start = max(0, len(text) - new_text_len - len(s) + 1)
        pos = text.find(s, start)
        if pos != -1 and (best_pos == -1 or pos < best_pos):
            best_pos, best_idx = pos, idx
    if best_pos == -1:
        return None
    end = best_pos + len(stop[best_idx]) if include_stop_str_in_output else best_pos
    return text[:end], best_idx
