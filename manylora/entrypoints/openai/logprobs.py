"""Log-probabilities as OpenAI's JSON carries them (vLLM's shapes): the legacy completions
``logprobs`` object (tokens, ``token_logprobs``, ``top_logprobs`` maps, ``text_offset``) and
the chat ``logprobs.content`` list (per token its text, log-probability, UTF-8 bytes and
``top_logprobs``). JSON has no ``-inf``: values below :data:`LOGPROB_FLOOR` are sent as it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from manylora.engine.outputs import Logprob
from manylora.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
)

__all__ = ["LOGPROB_FLOOR", "chat_logprobs", "clamp_logprob", "completion_logprobs",
           "decoded_token", "token_text"]

#: JSON has no -inf: log-probabilities below this are sent as this (as vLLM).
LOGPROB_FLOOR = -9999.0


def clamp_logprob(value: float) -> float:
    """A log-probability JSON can carry: ``-inf`` (and anything below) becomes
    :data:`LOGPROB_FLOOR`, NaN too."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def token_text(token_id: int, decoded: str | None, as_token_id: bool = False) -> str:
    """A token's text for log-probabilities: its decoded text, or ``token_id:<id>`` (vLLM's
    form) when asked for (``return_tokens_as_token_ids``) or without a tokenizer."""
    return f"token_id:{token_id}" if as_token_id or decoded is None else decoded


def completion_logprobs(token_ids: Sequence[int],
                        logprobs: Sequence[dict[int, Logprob] | None],
                        num_top: int, initial_offset: int = 0,
                        as_token_ids: bool = False,
                        decode: Callable[[int], str | None] | None = None
                        ) -> CompletionLogProbs:
    """The legacy ``logprobs`` object of some tokens (generated ones, after the prompt's
    when echoed).

    Args:
        token_ids: the ids.
        logprobs: their ``{token_id: Logprob}`` dicts (the token first, then the top
            ``num_top``), as ``CompletionOutput.logprobs`` and
            ``RequestOutput.prompt_logprobs``; None for a token without one (the prompt's
            first): its ``token_logprobs`` and ``top_logprobs`` entries are null.
        num_top: the request's ``logprobs``; each ``top_logprobs`` map holds the token and
            the ``num_top`` most likely (``num_top + 1`` entries at most).
        initial_offset: ``text_offset`` of the first token (the characters before it).
        as_token_ids: name tokens ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``)
            instead of by their text.
        decode: the text of a token whose entry is None (None: ``token_id:<id>``).

    Returns:
        ``tokens`` (token texts), ``token_logprobs``, ``top_logprobs`` and ``text_offset``
        (running sum of the decoded token texts' lengths); ``-inf`` is sent as -9999.0.
    """
    out = CompletionLogProbs()
    offset = initial_offset
    for token_id, entries in zip(token_ids, logprobs):
        if entries is None:
            decoded = None if decode is None else decode(token_id)
            out.tokens.append(token_text(token_id, decoded, as_token_ids))
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(token_text(token_id, decoded))
            continue
        sampled = entries.get(token_id)
        decoded = decoded_token(entries, token_id)
        out.tokens.append(token_text(token_id, decoded, as_token_ids))
        out.token_logprobs.append(None if sampled is None else clamp_logprob(sampled.logprob))
        top: dict[str, float] = {}
        for k, (tid, lp) in enumerate(entries.items()):
            if k > num_top:
                break
            top.setdefault(token_text(tid, lp.decoded_token, as_token_ids),
                           clamp_logprob(lp.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token_text(token_id, decoded))
    return out


def decoded_token(entries: dict[int, Logprob] | None, token_id: int) -> str | None:
    """The sampled token's text in its log-probability entries (``Logprob.decoded_token``),
    or None."""
    sampled = None if entries is None else entries.get(token_id)
    return None if sampled is None else sampled.decoded_token


def _logprob_entry(token_id: int, lp: Logprob, as_token_id: bool) -> ChatCompletionLogProb:
    text = token_text(token_id, lp.decoded_token, as_token_id)
    return ChatCompletionLogProb(token=text, logprob=clamp_logprob(lp.logprob),
                                 bytes=list(text.encode("utf-8", errors="replace")))


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]],
                  num_top: int, as_token_ids: bool = False) -> ChatCompletionLogProbs:
    """The chat ``logprobs`` object of some generated tokens.

    Args:
        token_ids: the generated ids.
        logprobs: their ``{token_id: Logprob}`` dicts (sampled token first, then the top
            ``num_top``; ``num_top`` entries in all when the sampled token is among them),
            as ``CompletionOutput.logprobs``.
        num_top: the request's ``top_logprobs``.
        as_token_ids: name tokens ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``)
            instead of by their text.

    Returns:
        ``{"content": [...]}``: per token its text, log-probability (``-inf`` as -9999.0),
        UTF-8 bytes and its ``top_logprobs``: the ``num_top`` most likely tokens, most
        likely first (the sampled token only when it is one of them).
    """
    content = []
    for token_id, entries in zip(token_ids, logprobs):
        items = list(entries.items())
        if len(items) > num_top:         # the sampled token came on top of the N best
            items = [(tid, lp) for tid, lp in items if tid != token_id]
        items.sort(key=lambda item: -item[1].logprob)
        top = [_logprob_entry(tid, lp, as_token_ids) for tid, lp in items[:num_top]]
        sampled = entries.get(token_id)
        if sampled is None:
            sampled = Logprob(float("-inf"))
        entry = _logprob_entry(token_id, sampled, as_token_ids)
        content.append(ChatCompletionLogProbsContent(
            token=entry.token, logprob=entry.logprob, bytes=entry.bytes, top_logprobs=top))
    return ChatCompletionLogProbs(content=content)
