"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``, vLLM's meaning).

For a prompt ``x_0 .. x_{P-1}`` the entry of position ``j`` (``1 <= j < P``) is
``log_softmax(logits(h_{j-1}))[x_j]`` (the raw model distribution, float32, as
``sample.logprobs.compute_logprobs``), its rank, and the top ``N`` tokens at that position;
position 0 has no entry (the front reports None for it). ``h_{j-1}`` is the hidden state of
prompt position ``j - 1`` computed by the prefill step itself, after every LoRA delta of the
request's adapter, so nothing runs twice.

A prefill chunk computing positions ``[s, s + n)`` of a prompt yields the entries of
positions ``s + 1 .. min(s + n, P - 1)``; the chunks of one prompt arrive in order and the
engine core drops entries it has already reported (a preempted request computes its prompt
again). Per step the rows that ask are gathered, their logits computed in chunks of at most
``PROMPT_LOGITS_ELEMENTS`` floats (so a long prompt never materializes ``[P, V]`` at once;
the chunking depends only on the row count and ``V``, so tensor-parallel ranks run the
same all-gathers), and everything is flattened into one float64 tensor that rides the step's
one device-to-host copy (``worker.async_output``).

What crosses to the front is :class:`PromptLogprobs`: numpy arrays, never per-token dicts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = [
    "PROMPT_LOGITS_ELEMENTS",
    "PromptLogprobs",
    "PromptLogprobsPlan",
    "compute_prompt_logprobs",
    "prompt_logits_chunks",
    "unpack_prompt_logprobs",
]

#: The most logits (floats) one chunk of prompt positions materializes: 2**26 (256 MiB of
#: float32), e.g. 512 positions of a 128k vocabulary.
PROMPT_LOGITS_ELEMENTS = 1 << 26


@dataclass
class PromptLogprobs:
    """Prompt log-probabilities of consecutive prompt positions of one request (host).

    Attributes:
        start: the prompt position of the first entry (``>= 1``).
        logprobs: float32 ``[M]``, ``log p(x_j | x_<j)`` for ``j = start .. start + M - 1``.
        ranks: int64 ``[M]``, 1 + the tokens with a strictly larger log-probability.
        topk_ids: int64 ``[M, K]``, the K most likely tokens at each position (most likely
            first; K is the request's ``prompt_logprobs``).
        topk_logprobs: float32 ``[M, K]``, their log-probabilities.

    The arrays are typed ``Any`` so that msgspec carries them as raw bytes
    (``engine.serial``).
    """

    start: int
    logprobs: Any
    ranks: Any
    topk_ids: Any
    topk_logprobs: Any

    def __len__(self) -> int:
        return int(self.logprobs.shape[0])

    def drop_before(self, position: int) -> PromptLogprobs | None:
        """The entries of positions ``>= position`` (None when none is left)."""
        skip = max(0, position - self.start)
        if skip >= len(self):
            return None
        if not skip:
            return self
        return PromptLogprobs(self.start + skip, self.logprobs[skip:], self.ranks[skip:],
                              self.topk_ids[skip:], self.topk_logprobs[skip:])


class PromptLogprobsPlan(NamedTuple):
    """A step's prompt log-probability rows, built by ``InputBatch.prepare`` (host).

    Attributes:
        req_ids: the requests with entries this step, in step order.
        starts: per request, the prompt position of its first entry this step.
        counts: per request, its entries this step (its rows in the step's prompt rows, in
            order, ``sum(counts)`` in all).
        num_logprobs: per request, its K (``SamplingParams.prompt_logprobs``).
    """

    req_ids: list[str]
    starts: list[int]
    counts: list[int]
    num_logprobs: list[int]


def prompt_logits_chunks(num_rows: int, vocab_size: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]``: the row ranges whose logits are computed together (at most
    ``PROMPT_LOGITS_ELEMENTS`` floats each); the same on every tensor-parallel rank."""
    step = max(1, PROMPT_LOGITS_ELEMENTS // max(1, vocab_size))
    return [(lo, min(lo + step, num_rows)) for lo in range(0, num_rows, step)]


def compute_prompt_logprobs(hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
                            num_logprobs: int,
                            compute_logits: Callable[[torch.Tensor, int, int], torch.Tensor],
                            vocab_size: int) -> torch.Tensor:
    """The flattened prompt log-probabilities of a step's prompt rows, on the device.

    Per row ``r``: ``lp = log_softmax(logits(hidden[rows[r]]))`` (float32), then
    ``[lp[targets[r]], rank, topk ids (K), topk logprobs (K)]`` with
    ``rank = 1 + #{v : lp[v] > lp[targets[r]]}`` and ``K = min(num_logprobs, V)``.

    Args:
        hidden: ``[T, hidden]`` the step's hidden states (any float dtype).
        rows: int ``[M]`` indices into ``hidden`` (the prompt positions ``j - 1``).
        targets: int ``[M]`` the prompt tokens ``x_j`` they predict, in ``[0, V)``.
        num_logprobs: K, the largest ``prompt_logprobs`` of the step's rows (``>= 0``).
        compute_logits: ``(hidden [m, hidden], lo, hi) -> float32 [m, V]``, the logits of
            ``rows[lo:hi]`` (a collective under tensor parallelism: call this on every rank,
            with the same M).
        vocab_size: V (sizes the chunks, :func:`prompt_logits_chunks`).

    Returns:
        float64 ``[M * (2 + 2K)]`` (exact for float32 values and ids below 2**53).

    Raises:
        ValueError: ``rows`` and ``targets`` differ in shape, or ``num_logprobs < 0``.
    """
    if rows.shape != targets.shape:
        raise ValueError(f"rows {tuple(rows.shape)} and targets {tuple(targets.shape)} differ")
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be >= 0, got {num_logprobs}")
    parts = []
    k = min(num_logprobs, vocab_size)
    for lo, hi in prompt_logits_chunks(rows.shape[0], vocab_size):
        logits = compute_logits(hidden.index_select(0, rows[lo:hi].long()), lo, hi)
        lp = logits.log_softmax(dim=-1, dtype=torch.float32)
        token = lp.gather(-1, targets[lo:hi].long().unsqueeze(-1))
        rank = (lp > token).sum(dim=-1, keepdim=True) + 1
        top_lp, top_ids = lp.topk(k, dim=-1)
        parts.append(torch.cat([token.double(), rank.double(), top_ids.double(),
                                top_lp.double()], dim=-1).flatten())
    if not parts:
        return torch.zeros(0, dtype=torch.float64, device=hidden.device)
    return torch.cat(parts)


def unpack_prompt_logprobs(host: np.ndarray, plan: PromptLogprobsPlan,
                           vocab_size: int) -> dict[str, PromptLogprobs]:
    """The inverse of :func:`compute_prompt_logprobs` on the host: ``host`` is its float64
    result as numpy, ``plan`` the step's plan (K is ``max(plan.num_logprobs)`` clamped to
    V); each request's top lists are cut to its own K.

    Returns:
        ``{request_id: PromptLogprobs}`` for every request of the plan.
    """
    k = min(max(plan.num_logprobs, default=0), vocab_size)
    table = host.reshape(-1, 2 + 2 * k)
    out = {}
    at = 0
    for rid, start, count, own in zip(plan.req_ids, plan.starts, plan.counts,
                                      plan.num_logprobs):
        rec = table[at:at + count]
        at += count
        own = min(own, k)
        out[rid] = PromptLogprobs(start, rec[:, 0].astype(np.float32),
                                  rec[:, 1].astype(np.int64),
                                  rec[:, 2:2 + own].astype(np.int64),
                                  rec[:, 2 + k:2 + k + own].astype(np.float32))
    return out
