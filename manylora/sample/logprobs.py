"""Per-token log-probabilities of ``SamplingParams.logprobs``, and their way to the host.

Follows vLLM v1's ``Sampler.compute_logprobs`` / ``gather_logprobs`` with its default
``logprobs_mode="raw_logprobs"``: ``log_softmax`` of the raw logits, before any sampling
transform. A step's sampled tokens and the log-probabilities of the rows that asked for
them travel to the host in one device-to-host copy (``flatten_tokens_and_logprobs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = [
    "LogprobsTensors",
    "TokenLogprobs",
    "compute_logprobs",
    "flatten_tokens_and_logprobs",
    "tokens_and_logprobs_to_host",
    "unflatten_tokens_and_logprobs",
]


class LogprobsTensors(NamedTuple):
    """Log-probabilities of M sampled rows, on the logits' device (the fields of vLLM v1's
    ``LogprobsTensors``, with the sampled token kept apart from the top-K).

    All log-probabilities are natural logs of the raw model distribution,
    ``log_softmax(logits)`` in float32.

    Fields:
        token_logprob: ``[M]`` float32, the log-probability of each row's sampled token.
        token_rank: ``[M]`` int64, the sampled token's rank: 1 + the number of tokens of the
            row whose log-probability is strictly larger (1 = a most likely token). vLLM
            counts the tokens ``>=`` instead, which differs only on exact ties.
        topk_ids: ``[M, K]`` int64, the K most likely token ids, most likely first (ties in
            ``torch.topk``'s order).
        topk_logprobs: ``[M, K]`` float32, their log-probabilities, non-increasing along
            dim 1.
    """

    token_logprob: torch.Tensor
    token_rank: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor


class TokenLogprobs(NamedTuple):
    """One generated token's log-probabilities, on the host as plain Python values.

    Fields:
        logprob: the sampled token's log-probability (natural log, a float32 value).
        rank: the sampled token's rank, 1 = most likely (see :class:`LogprobsTensors`).
        topk_ids: the request's ``SamplingParams.logprobs`` most likely token ids, most
            likely first (empty for ``logprobs=0``; fewer when the vocabulary is smaller).
        topk_logprobs: their log-probabilities, same length, non-increasing.
    """

    logprob: float
    rank: int
    topk_ids: list[int]
    topk_logprobs: list[float]


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Log-probabilities of the sampled tokens and the top ``num_logprobs`` tokens per row.

    As vLLM v1's ``Sampler.compute_logprobs`` + ``Sampler.gather_logprobs`` in its default
    ``"raw_logprobs"`` mode: ``logprobs = log_softmax(logits)`` in float32, the sampled
    token's entry gathered, the top-K by ``torch.topk``. Pass the raw model logits (before
    temperature, top-k, top-p and min-p), so the values do not depend on how the token was
    drawn. One batched computation, no host sync.

    Args:
        logits: ``[M, V]`` logits (any float dtype; computed in float32). Not modified.
        token_ids: ``[M]`` integer token ids sampled from those rows, each in ``[0, V)``, on
            the logits' device.
        num_logprobs: K, how many top tokens to return per row; clamped to V.

    Returns:
        :class:`LogprobsTensors` with ``K = min(num_logprobs, V)``, on the logits' device.

    Raises:
        ValueError: ``logits`` is not 2-D, ``token_ids`` is not ``[M]``, or
            ``num_logprobs < 0``.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [M, V], got shape {tuple(logits.shape)}")
    if token_ids.shape != logits.shape[:1]:
        raise ValueError(f"token_ids must be [{logits.shape[0]}], got shape "
                         f"{tuple(token_ids.shape)}")
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be >= 0, got {num_logprobs}")
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
    token_logprob = logprobs.gather(-1, token_ids.to(torch.int64).unsqueeze(-1))
    token_rank = (logprobs > token_logprob).sum(dim=-1) + 1
    topk_logprobs, topk_ids = logprobs.topk(min(num_logprobs, logprobs.shape[-1]), dim=-1)
    return LogprobsTensors(token_logprob.squeeze(-1), token_rank, topk_ids, topk_logprobs)


def flatten_tokens_and_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    rows: Sequence[int],
    num_logprobs: Sequence[int],
) -> tuple[torch.Tensor, int]:
    """A step's sampled tokens, and the log-probabilities of the rows that asked for them,
    as one device tensor for a single device-to-host copy (nothing waits for the device).

    With ``rows`` empty the tensor is ``tokens`` itself: no log-probability work at all.
    Otherwise :func:`compute_logprobs` runs once on the selected rows with K the largest
    ``num_logprobs``, and tokens, sampled log-probs, ranks, top-K ids and top-K log-probs
    are flattened into one float64 tensor (exact for float32 values and for integers below
    2**53): ``[tokens (N) | per row of rows: logprob, rank, K ids, K logprobs]``.

    Args:
        logits: ``[N, V]`` raw logits of the step's sampled rows (see
            :func:`compute_logprobs`).
        tokens: ``[N]`` int64 sampled token ids, on the logits' device.
        rows: indices in ``[0, N)`` of the rows that want log-probabilities.
        num_logprobs: one count in ``[0, MAX_LOGPROBS]`` per entry of ``rows``.

    Returns:
        ``(flat, K)``: int64 ``[N]`` or float64 ``[N + len(rows) * (2 + 2K)]``, and K (0
        without rows).

    Raises:
        ValueError: ``rows`` and ``num_logprobs`` differ in length.
    """
    if len(rows) != len(num_logprobs):
        raise ValueError(f"{len(rows)} rows but {len(num_logprobs)} num_logprobs")
    if not rows:
        return tokens, 0
    n = tokens.shape[0]
    if len(rows) == n and list(rows) == list(range(n)):
        sel_logits, sel_tokens = logits, tokens
    else:
        index = torch.tensor(list(rows), dtype=torch.int64)
        if logits.device.type == "cuda":
            index = index.pin_memory()
        index = index.to(logits.device, non_blocking=True)
        sel_logits, sel_tokens = logits.index_select(0, index), tokens.index_select(0, index)
    lp = compute_logprobs(sel_logits, sel_tokens, max(num_logprobs))
    k = lp.topk_ids.shape[1]
    flat = torch.cat([
        lp.token_logprob.to(torch.float64).unsqueeze(-1),
        lp.token_rank.to(torch.float64).unsqueeze(-1),
        lp.topk_ids.to(torch.float64),
        lp.topk_logprobs.to(torch.float64),
    ], dim=-1)
    return torch.cat([tokens.to(torch.float64), flat.flatten()]), k


def unflatten_tokens_and_logprobs(
    host: list, n: int, num_logprobs: Sequence[int], k: int
) -> tuple[list[int], list[TokenLogprobs]]:
    """The inverse of :func:`flatten_tokens_and_logprobs` on the host: ``host`` is the flattened
    tensor's ``tolist()``, ``n`` the number of sampled rows, ``k`` the K it returned.

    Returns:
        ``(token_ids, logprobs)``: the N sampled ids as ints, and one :class:`TokenLogprobs`
        per entry of ``num_logprobs``, each row's top-K lists cut to its own count.
    """
    if not num_logprobs:
        return host, []
    token_ids = [int(t) for t in host[:n]]
    width = 2 + 2 * k
    out: list[TokenLogprobs] = []
    for i, count in enumerate(num_logprobs):
        rec = host[n + i * width: n + (i + 1) * width]
        count = min(count, k)
        out.append(TokenLogprobs(rec[0], int(rec[1]), [int(t) for t in rec[2:2 + count]],
                                 rec[2 + k:2 + k + count]))
    return token_ids, out


def tokens_and_logprobs_to_host(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    rows: Sequence[int],
    num_logprobs: Sequence[int],
) -> tuple[list[int], list[TokenLogprobs]]:
    """Bring a step's sampled tokens, and the log-probabilities of the rows that asked for
    them, to the host in one device-to-host copy: :func:`flatten_tokens_and_logprobs`, one
    ``tolist()``, :func:`unflatten_tokens_and_logprobs`.

    Args:
        logits, tokens, rows, num_logprobs: as :func:`flatten_tokens_and_logprobs`.

    Returns:
        ``(token_ids, logprobs)``: the N sampled ids as ints, and one :class:`TokenLogprobs`
        per entry of ``rows``, in the same order.

    Raises:
        ValueError: ``rows`` and ``num_logprobs`` differ in length.
    """
    flat, k = flatten_tokens_and_logprobs(logits, tokens, rows, num_logprobs)
    return unflatten_tokens_and_logprobs(flat.tolist(), tokens.shape[0], num_logprobs, k)
