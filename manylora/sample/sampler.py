"""Batched token sampler: temperature, top-k, top-p, min-p, then the exponential race;
and the per-token log-probabilities of ``SamplingParams.logprobs``.

Follows vLLM's sampler (order of the filters, greedy threshold, the ``probs / q`` draw with
``q ~ Exponential(1)``, and per-request ``torch.Generator`` for seeded requests). Log-probs
follow vLLM v1's ``Sampler.compute_logprobs`` / ``gather_logprobs`` with its default
``logprobs_mode="raw_logprobs"``: ``log_softmax`` of the raw logits, before any sampling
transform.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from manylora.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "LogprobsTensors",
    "SampledTokens",
    "Sampler",
    "SamplingTensors",
    "TokenLogprobs",
    "compute_logprobs",
    "flag_empty_rows",
    "make_generator",
    "flatten_tokens_and_logprobs",
    "tokens_and_logprobs_to_host",
    "unflatten_tokens_and_logprobs",
]


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (torch's seeds every device's
    too), as vLLM's ``--seed`` does: the draws of unseeded requests come from torch's."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """Return a ``torch.Generator`` on ``device`` seeded with ``seed``.

    One generator per seeded request; the sampler draws that request's noise from it only,
    so its tokens do not depend on the rest of the batch (as vLLM's seeded sampling).
    """
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(int(seed))
    return g


class SamplingTensors(NamedTuple):
    """Per-row sampling parameters of one batch, as device tensors.

    Fields:
        temperature: ``[N]`` float32; rows below 1e-5 are greedy (written as exactly 0.0).
        top_k: ``[N]`` int64; 0 means off (values ``>= vocab_size`` are written as 0).
        top_p: ``[N]`` float32 in (0, 1]; 1 means off.
        min_p: ``[N]`` float32 in [0, 1]; 0 means off.
        all_greedy: every row is greedy (host-side flag; no sampling needed).
        all_random: no row is greedy.
        do_top_k / do_top_p / do_min_p: some random row uses that filter (host-side flags
            that let the sampler skip the sort / extra softmax). Default True (safe).

    Greedy rows get neutral top_k/top_p/min_p so they do not set the ``do_*`` flags.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    all_greedy: bool
    all_random: bool
    do_top_k: bool = True
    do_top_p: bool = True
    do_min_p: bool = True

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingTensors:
        """Build the tensors for ``params`` (one per batch row) on ``device``.

        The four columns are stacked on the host into one float64 ``[4, N]`` tensor (pinned
        when going to CUDA), moved with a single ``non_blocking`` copy and split on the
        device (float64 holds every int64 top_k below 2**53 exactly).

        Args:
            params: the rows' sampling parameters, in batch order.
            vocab_size: V, the logits' last dimension; top_k >= V is treated as off.
            device: where the sampler runs.

        Returns:
            SamplingTensors with ``[N]`` tensors on ``device``.
        """
        device = torch.device(device)
        temps: list[float] = []
        top_ks: list[float] = []
        top_ps: list[float] = []
        min_ps: list[float] = []
        do_top_k = do_top_p = do_min_p = False
        n_greedy = 0
        for p in params:
            if p.greedy:
                n_greedy += 1
                temps.append(0.0)
                top_ks.append(0.0)
                top_ps.append(1.0)
                min_ps.append(0.0)
                continue
            k = p.top_k if 0 < p.top_k < vocab_size else 0
            temps.append(p.temperature)
            top_ks.append(float(k))
            top_ps.append(p.top_p)
            min_ps.append(p.min_p)
            do_top_k |= k > 0
            do_top_p |= p.top_p < 1.0
            do_min_p |= p.min_p > 0.0
        n = len(temps)
        host = torch.tensor([temps, top_ks, top_ps, min_ps], dtype=torch.float64)
        host = host.reshape(4, n)
        if device.type == "cuda" and torch.cuda.is_available():
            host = host.pin_memory()
        stacked = host.to(device, non_blocking=True)
        return cls(
            temperature=stacked[0].to(torch.float32),
            top_k=stacked[1].to(torch.int64),
            top_p=stacked[2].to(torch.float32),
            min_p=stacked[3].to(torch.float32),
            all_greedy=n_greedy == n,
            all_random=n_greedy == 0,
            do_top_k=do_top_k,
            do_top_p=do_top_p,
            do_min_p=do_min_p,
        )


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (set to ``-inf``) the logits outside each row's top-k and top-p sets.

    Args:
        logits: ``[N, V]`` float32, already divided by the temperature. Not modified.
        top_k: ``[N]`` int64, 0 (or ``>= V``) = off; None skips top-k.
        top_p: ``[N]`` float32 in (0, 1], 1 = off; None skips top-p.

    Returns:
        New ``[N, V]`` float32 logits. Top-k keeps every token whose logit is ``>=`` the
        k-th largest (ties kept). Top-p then keeps, among the remaining tokens sorted by
        probability, the smallest most-probable set whose cumulative probability is
        ``>= top_p`` (the top token always stays); as vLLM, with one ascending sort.
    """
    vocab = logits.shape[-1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
        # Ascending order: the k-th largest sits at position V - k.
        kth = logits_sort.gather(-1, (vocab - k).unsqueeze(-1))
        logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    if top_p is not None:
        probs_sort = logits_sort.softmax(dim=-1)
        cum = probs_sort.cumsum(dim=-1)
        # Drop token i when the tokens ranked above it already hold >= top_p of the mass.
        drop = cum <= (1.0 - top_p).unsqueeze(-1)
        drop[:, -1] = False
        logits_sort.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits_sort).scatter_(-1, logits_idx, logits_sort)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask the tokens whose probability is below ``min_p * max probability`` of their row.

    Args:
        logits: ``[N, V]`` float32. Modified in place and returned.
        min_p: ``[N]`` float32 in [0, 1]; 0 = off.
    """
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


class Sampler:
    """Pick one next token per row of a logits batch, as vLLM does.

    For row ``i`` with logits ``l`` (float32, ``[V]``):

    * greedy (``temperature[i] < 1e-5``): ``argmax(l)`` of the raw logits;
    * random: ``l' = l / temperature[i]``, then top-k, top-p and min-p masks (in that order,
      masked logits are ``-inf``), ``p = softmax(l')`` and the token is
      ``argmax(p / q)`` with ``q ~ Exponential(1)`` i.i.d. per token (the exponential race,
      equivalent to drawing from ``p``). Rows present in ``generators`` draw their ``q``
      with their own generator (``torch.empty(V).exponential_(generator=g)``), so a seeded
      request's tokens do not depend on the batch; the other rows' ``q`` comes from the
      default generator in one batched call.

    Work that is not needed is skipped when the host knows it is not: pass the
    ``SamplingTensors`` flags (or use :meth:`sample`). Without flags and with CPU tensors
    the flags are read from the tensors; without flags on an accelerator the sampler runs
    every step for every row and merges with ``torch.where`` (no host sync).
    """

    def __call__(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        generators: Mapping[int, torch.Generator],
        *,
        all_greedy: bool | None = None,
        all_random: bool | None = None,
        do_top_k: bool | None = None,
        do_top_p: bool | None = None,
        do_min_p: bool | None = None,
    ) -> torch.Tensor:
        """Sample one token per row.

        Args:
            logits: ``[N, V]`` logits (any float dtype; computed in float32). Not modified.
            temperature: ``[N]`` float32; ``< 1e-5`` = greedy.
            top_k: ``[N]`` int64; 0 = off.
            top_p: ``[N]`` float32 in (0, 1]; 1 = off.
            min_p: ``[N]`` float32 in [0, 1]; 0 = off.
            generators: row index -> ``torch.Generator`` (on the logits' device) for seeded
                rows.
            all_greedy, all_random, do_top_k, do_top_p, do_min_p: optional host-side
                knowledge of the batch (see :class:`SamplingTensors`); None = unknown.

        Returns:
            ``[N]`` int64 token ids, on the logits' device.
        """
        logits = logits.to(torch.float32)
        n, vocab = logits.shape
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)

        if temperature.device.type == "cpu":
            # Reading CPU tensors costs no device sync.
            greedy_rows = temperature < GREEDY_TEMPERATURE_EPS
            random_rows = ~greedy_rows
            if all_greedy is None:
                all_greedy = bool(greedy_rows.all())
            if all_random is None:
                all_random = not bool(greedy_rows.any())
            if do_top_k is None:
                do_top_k = bool(((top_k > 0) & (top_k < vocab) & random_rows).any())
            if do_top_p is None:
                do_top_p = bool(((top_p < 1.0) & random_rows).any())
            if do_min_p is None:
                do_min_p = bool(((min_p > 0.0) & random_rows).any())

        if all_greedy:
            return logits.argmax(dim=-1)

        is_greedy = temperature < GREEDY_TEMPERATURE_EPS
        if all_random:
            scaled = logits / temperature.unsqueeze(-1)
        else:
            safe_t = torch.where(is_greedy, torch.ones_like(temperature), temperature)
            scaled = logits / safe_t.unsqueeze(-1)

        if do_top_k is not False or do_top_p is not False:
            scaled = apply_top_k_top_p(
                scaled,
                top_k if do_top_k is not False else None,
                top_p if do_top_p is not False else None,
            )
        if do_min_p is not False:
            scaled = apply_min_p(scaled, min_p)

        probs = scaled.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()
        for row, gen in generators.items():
            if 0 <= row < n:
                q[row] = torch.empty(vocab, device=probs.device, dtype=probs.dtype).exponential_(
                    generator=gen
                )
        # exponential_ may return exactly 0 on some backends; keep the ratio finite.
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        sampled = probs.div_(q).argmax(dim=-1)

        if all_random:
            return sampled
        return torch.where(is_greedy, logits.argmax(dim=-1), sampled)

    def sample(
        self,
        logits: torch.Tensor,
        tensors: SamplingTensors,
        generators: Mapping[int, torch.Generator],
    ) -> torch.Tensor:
        """Sample with the tensors and host-side flags of ``tensors``; see ``__call__``.

        Args:
            logits: ``[N, V]`` float logits.
            tensors: from :meth:`SamplingTensors.from_params` for the same N rows.
            generators: row index -> generator for seeded rows.

        Returns:
            ``[N]`` int64 token ids.
        """
        return self(
            logits,
            tensors.temperature,
            tensors.top_k,
            tensors.top_p,
            tensors.min_p,
            generators,
            all_greedy=tensors.all_greedy,
            all_random=tensors.all_random,
            do_top_k=tensors.do_top_k,
            do_top_p=tensors.do_top_p,
            do_min_p=tensors.do_min_p,
        )


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


class SampledTokens(NamedTuple):
    """What ``ModelRunner.execute`` returns for one step, on the host.

    Fields:
        tokens: ``{request_id: token_id}`` for every request that sampled this step.
        logprobs: ``{request_id: TokenLogprobs}`` for those of them whose
            ``SamplingParams.logprobs`` is not None (empty when none asked).
        prompt_logprobs: ``{request_id: PromptLogprobs}``
            (``sample.prompt_logprobs``) of the requests whose prompt positions the step
            computed with ``SamplingParams.prompt_logprobs`` set (sampled or not).
        no_token: the requests whose masks allowed no token this step
            (``flag_empty_rows``); their entry in ``tokens`` is the id the device picked
            anyway and must not be reported.
    """

    tokens: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    prompt_logprobs: dict = {}
    no_token: frozenset[str] = frozenset()


def flag_empty_rows(tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The sampled tokens as reported to the host, with the rows whose masks allowed no
    token marked: ``r[i] = t[i]`` when ``l[i, t[i]]`` is finite, else ``-1 - t[i]``.

    A row whose grammar bitmask, ``allowed_token_ids`` and ``bad_words`` together exclude
    every token has every logit ``-inf``; the sampler still returns some id for it (argmax
    of an all ``-inf`` or NaN row), which must not reach the request. The mark keeps the
    id (``-1 - r``) so the host can still append what the device will read next step.
    Any finite logit wins both greedy and random sampling, so a finite chosen logit means
    the row had a token to choose.

    Args:
        tokens: int64 ``[N]`` sampled ids, on the logits' device.
        logits: ``[N, V]`` the logits they were sampled from (masks applied, before
            temperature).

    Returns:
        int64 ``[N]``, on the same device; no host sync.
    """
    chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return torch.where(chosen > float("-inf"), tokens, -1 - tokens)


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
