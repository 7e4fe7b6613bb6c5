"""Batched token sampler: temperature, top-k, top-p, min-p, then the exponential race.

Follows vLLM's sampler (order of the filters, greedy threshold, the ``probs / q`` draw with
``q ~ Exponential(1)``, and per-request ``torch.Generator`` for seeded requests,
``sample/generators.py``). The filters are in ``sample/filters.py``, the log-probabilities
of ``SamplingParams.logprobs`` in ``sample/logprobs.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from manylora.sample.filters import apply_min_p, apply_top_k_top_p
from manylora.sample.logprobs import TokenLogprobs
from manylora.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams

__all__ = [
    "SampledTokens",
    "Sampler",
    "SamplingTensors",
    "flag_empty_rows",
]


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
