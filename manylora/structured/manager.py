"""``StructuredOutputManager``: the core's grammar state (vLLM v1's
``StructuredOutputManager``): requests held while their grammar compiles, one xgrammar
``GrammarMatcher`` per running request, and each step's token bitmask of the sampled rows
that carry one. It holds no device tensor: the model runner copies the bitmask to the
device and applies it (``ops.token_bitmask``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from manylora.request import Request
from manylora.structured.bad_words import BadWords, clear_tokens
from manylora.structured.compiler import GrammarCompileService
from manylora.structured.grammar import grammar_key

__all__ = ["StructuredOutputManager", "bitmask_words", "no_token_error"]

logger = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's token bitmask: ``ceil(vocab_size / 32)``."""
    return -(-vocab_size // 32)


def no_token_error(req: Request, grammar: bool, generated: int) -> ValueError:
    """The error that ends ``req`` when its output constraints allow no next token: names
    the constraints it carries (its grammar when ``grammar``, ``allowed_token_ids``,
    ``bad_words``) and the output position (``generated`` tokens before it)."""
    params = req.sampling_params
    names = ["structured_outputs"] if grammar else []
    if params.allowed_token_ids is not None:
        names.append("allowed_token_ids")
    if params.bad_words_token_ids:
        names.append("bad_words")
    if len(names) > 1:
        which = " and ".join(names) + " together allow"
    else:
        which = {"structured_outputs": "the grammar of structured_outputs allows",
                 "bad_words": "bad_words leaves"}.get(names[0] if names else "",
                                                      "the sampling constraints allow")
    return ValueError(f"{names[0] if names else 'request'}: {which} no token after the "
                      f"{generated} generated so far")


class StructuredOutputManager:
    """Grammars of the core's requests, from compile to the last token.

    A request with ``structured_outputs`` is held here (not in the scheduler) while its
    grammar compiles on the compile service's thread; ``poll`` hands it back to be queued
    once compiled (its matcher made) or with the error when the grammar does not compile.
``fill`` also bans the tokens of ``bad_words`` (``structured.bad_words``) through the same
host mask.
    Each token sampled for it is ``accept``-ed by its matcher (no rollback: no speculative
    decoding); ``fill`` writes the next-token bitmask of the sampled rows that have a live
    matcher. A matcher terminated by a stop token constrains nothing more: the request
    ends there, ``min_tokens`` or not (``terminated``), unless ``ignore_eos`` (generation
    then goes on unconstrained, as in vLLM). Below ``min_tokens`` the stop tokens are
    cleared from a row's mask only where the grammar allows another token. A grammar that
    allows no first token (with ``allowed_token_ids`` and ``bad_words``) fails at ``poll``;
    one that runs into a dead end later is caught by the sampler
    (``sample.sampler.flag_empty_rows``). Preemption keeps the matcher.

    Args:
        compiler: the ``GrammarCompileService``; None: the engine has no tokenizer
            (``skip_tokenizer_init``) and ``check`` refuses every grammar.
        vocab_size: V, the model's vocabulary (logit columns).
        max_num_seqs: the most sampled rows of a step (bitmask rows).
        pin_memory: allocate the bitmask host buffer in pinned memory (CUDA).

    Attributes:
        bitmask: int32 ``[max_num_seqs, 1 + ceil(V / 32)]`` host buffer, made on first use:
            row ``r`` holds the index of its sampled row in column 0 and the bitmask in the
            rest (bit ``j % 32`` of word ``j // 32``: token ``j`` allowed).
    """

    def __init__(self, compiler: GrammarCompileService | None, vocab_size: int,
                 max_num_seqs: int, pin_memory: bool) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.pin_memory = pin_memory
        self.bitmask: torch.Tensor | None = None
        self._fill_buffer: torch.Tensor | None = None
        self._batch: Any = None
        self._held: dict[str, tuple[Request, Future]] = {}
        self._matchers: dict[str, Any] = {}
        self._bad_words: dict[str, BadWords] = {}

    def check(self, request_id: str) -> None:
        """Refuse a grammar the engine cannot serve.

        Raises:
            ValueError: the engine was started with ``skip_tokenizer_init`` (xgrammar maps
                grammars onto the tokenizer's vocabulary).
        """
        if self.compiler is None:
            raise ValueError(f"request {request_id!r}: structured_outputs needs the "
                             "tokenizer, but the engine was started with skip_tokenizer_init")

    def hold(self, req: Request) -> None:
        """Start compiling ``req``'s grammar (cached: done at once) and hold ``req`` until
        ``poll`` hands it back."""
        key = grammar_key(req.sampling_params.structured_outputs)
        self._held[req.request_id] = (req, self.compiler.submit(key))

    @property
    def num_held(self) -> int:
        """Requests held for their grammar's compile."""
        return len(self._held)

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held

    def held(self, request_id: str) -> Request | None:
        """The request held under ``request_id`` (None: none is)."""
        entry = self._held.get(request_id)
        return None if entry is None else entry[0]

    def held_requests(self) -> list[Request]:
        """Every request held for its grammar's compile."""
        return [req for req, _ in self._held.values()]

    @property
    def active(self) -> bool:
        """Whether any request is held or has a matcher (else ending requests costs
        nothing here)."""
        return bool(self._held or self._matchers)

    @property
    def has_matchers(self) -> bool:
        """Whether any running request has a matcher (else sampled tokens skip
        ``accept``)."""
        return bool(self._matchers)

    def has_compiled(self) -> bool:
        """Whether a held request's compile has ended (``poll`` would hand it back)."""
        return any(f.done() for _, f in self._held.values())

    def release(self, request_id: str) -> Request | None:
        """Stop holding a request (aborted while its grammar compiles): a compile nobody
        else waits for is dropped (``GrammarCompileService.release``). Its ``Request``, or
        None when it was not held."""
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        req = held[0]
        self.compiler.release(grammar_key(req.sampling_params.structured_outputs))
        return req

    def poll(self) -> tuple[list[Request], list[tuple[Request, Exception]]]:
        """Held requests whose compile ended: ``(ready, failed)``; a ready one has its
        matcher (stop tokens: the request's EOS ids), a failed one its error."""
        if not self._held:
            return [], []
        import xgrammar as xgr

        ready, failed = [], []
        for rid in [rid for rid, (_, f) in self._held.items() if f.done()]:
            req, future = self._held.pop(rid)
            error = future.exception()
            if error is not None:
                failed.append((req, error))
                continue
            stop = sorted(req.eos_token_ids) or None
            matcher = xgr.GrammarMatcher(future.result(), override_stop_tokens=stop)
            if not self._admits_first_token(matcher, req):
                failed.append((req, no_token_error(req, True, req.num_output_tokens)))
                continue
            self._matchers[rid] = matcher
            ready.append(req)
        return ready, failed

    def _admits_first_token(self, matcher: Any, req: Request) -> bool:
        """Whether some token may start ``req``'s output: allowed by its grammar, in its
        ``allowed_token_ids`` and not banned by its ``bad_words``."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        row = mask.numpy().view(np.uint32)[0]
        bad = self._bad_words_of(req.request_id, req)
        if bad is not None:          # the one-token words: nothing else is banned first
            bad.clear(row, [])
        ids = req.sampling_params.allowed_token_ids
        if ids is None:
            return bool(row.any())
        ids = np.array([t for t in ids if 0 <= t < self.vocab_size], dtype=np.int64)
        return bool(((row[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).any())

    def has_matcher(self, request_id: str) -> bool:
        return request_id in self._matchers

    def accept(self, request_id: str, token: int) -> bool:
        """Advance ``request_id``'s matcher by a sampled token (nothing without a live
        matcher).

        Returns:
            False when the matcher rejects the token (the mask allowed a token the grammar
            does not: the request must end with an error, the others go on); else True.
        """
        matcher = self._matchers.get(request_id)
        if matcher is None or matcher.is_terminated():
            return True
        if matcher.accept_token(token):
            return True
        logger.error("request %s: the grammar rejects sampled token %d, which its bitmask "
                     "allowed", request_id, token)
        return False

    def terminated(self, request_id: str) -> bool:
        """Whether ``request_id``'s grammar has ended: its matcher accepted a stop token."""
        matcher = self._matchers.get(request_id)
        return matcher is not None and matcher.is_terminated()

    def remove(self, request_ids: Iterable[str]) -> None:
        """Forget the matchers of ended requests (and any still held)."""
        for rid in request_ids:
            self._matchers.pop(rid, None)
            self._bad_words.pop(rid, None)
            self.release(rid)

    def fill(self, req_ids: list[str], rows: np.ndarray,
             requests: Mapping[str, Request]) -> torch.Tensor | None:
        """The token masks of a step's sampled rows ``rows`` (indices into ``req_ids``, the
        step's sampled requests): a live matcher's next-token bitmask (every live matcher's
        in one call of xgrammar's ``BatchGrammarMatcher``, on its own threads), with the
        tokens ``bad_words_token_ids`` bans now (``BadWords.bans`` over the request's
        output in ``requests``, indexed on its first step) cleared.

        Returns:
            int32 ``[k, 1 + ceil(V / 32)]``, a view of ``bitmask`` (column 0: the sampled
            row; the rest: its mask; rows with a live matcher first), or None when no row
            is constrained now (matchers ended, no word to ban).
        """
        width = bitmask_words(self.vocab_size)
        if self.bitmask is None:
            self.bitmask = torch.empty((self.max_num_seqs, 1 + width), dtype=torch.int32,
                                       pin_memory=self.pin_memory)
            self._fill_buffer = torch.empty((self.max_num_seqs, width), dtype=torch.int32)
            import xgrammar as xgr
            self._batch = xgr.BatchGrammarMatcher(max_threads="auto")
        live_rows, live, banned_rows, bans, hold = [], [], [], [], []
        for i in rows.tolist():
            rid = req_ids[i]
            matcher = self._matchers.get(rid)
            req = requests.get(rid)
            bad = None if req is None else self._bad_words_of(rid, req)
            banned = None if bad is None else bad.bans(req.token_ids, req.num_prompt_tokens)
            if matcher is not None and not matcher.is_terminated():
                if (req is not None and req.eos_token_ids
                        and req.num_output_tokens < req.sampling_params.min_tokens):
                    hold.append((len(live), req.eos_token_ids))
                live_rows.append(i)
                live.append(matcher)
            elif banned is not None:
                banned_rows.append(i)
            else:
                continue
            if banned is not None:
                bans.append((i, bad, banned))
        m, k = len(live), len(live) + len(banned_rows)
        if not k:
            return None
        words = self.bitmask.numpy().view(np.uint32)
        if m:
            # xgrammar writes rows of a contiguous tensor only (a strided view is
            # written as if contiguous), hence the buffer and one copy
            self._batch.batch_fill_next_token_bitmask(live, self._fill_buffer[:m],
                                                      list(range(m)))
            words[:m, 1:] = self._fill_buffer[:m].numpy().view(np.uint32)
            for r, stops in hold:
                _hold_stop_tokens(words[r, 1:], stops)
        words[m:k, 1:] = 0xFFFFFFFF
        words[:k, 0] = live_rows + banned_rows
        if bans:
            position = {i: r for r, i in enumerate(live_rows + banned_rows)}
            for i, bad, banned in bans:
                bad.clear(words[position[i], 1:], banned)
        return self.bitmask[:k]

    def _bad_words_of(self, request_id: str, req: Request) -> BadWords | None:
        """``req``'s ``bad_words_token_ids`` index, built on first use (None: no words)."""
        bad = self._bad_words.get(request_id)
        if bad is None and req.sampling_params.bad_words_token_ids:
            bad = self._bad_words[request_id] = BadWords(
                req.sampling_params.bad_words_token_ids, self.vocab_size)
        return bad


def _hold_stop_tokens(row: np.ndarray, stops: Iterable[int]) -> None:
    """Clear the bits of ``stops`` in one uint32 bitmask row (``min_tokens`` not reached),
    unless they are all the grammar allows: then the row is left as it is, and the request
    ends on the stop token."""
    kept = row.copy()
    clear_tokens(row, np.fromiter((t for t in stops if (t >> 5) < row.shape[0]),
                                  dtype=np.int64))
    if not row.any():
        row[:] = kept
