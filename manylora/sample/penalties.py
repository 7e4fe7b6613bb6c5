"""Logits processors of the sampler: ``allowed_token_ids``, ``logit_bias`` and the
repetition, frequency and presence penalties, batched over the rows that use any.

Follows vLLM v1's sampler (``Sampler.apply_logits_processors`` then
``vllm.model_executor.layers.utils.apply_penalties``). For a row with logits ``l`` ``[V]``,
prompt tokens ``P``, output (generated) tokens ``O`` with counts ``c[t]`` (times ``t`` occurs
in ``O``):

1. ``allowed_token_ids`` A: ``l[t] = -inf`` for ``t`` not in A;
2. ``logit_bias`` b: ``l[t] += b[t]``;
3. repetition penalty r, for ``t`` in ``P ∪ O``: ``l[t] = l[t] / r`` if ``l[t] > 0`` else
   ``l[t] * r`` (CTRL, Keskar et al. 2019);
4. ``l[t] -= frequency_penalty * c[t] + presence_penalty * [c[t] > 0]``.

Temperature and the filters come after, on the processed logits; a step whose rows use none
of these never builds any of this (``PenaltyInputs`` is None).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

__all__ = ["PenaltyInputs", "apply_penalties", "penalize_logits"]


class PenaltyInputs(NamedTuple):
    """Host arrays for the ``P`` sampled rows of a step that use a logits processor.

    Fields:
        index: int64 ``[P]``, their indices among the step's sampled rows (increasing).
        tokens: int64 ``[P, L]``, each row's tokens on the host (prompt then output),
            padded with V.
        num_prompt: int64 ``[P]``, prompt tokens of each row.
        num_tokens: int64 ``[P]``, tokens of each row held on the host.
        pending: int64 ``[P]``, for a row whose newest output token is still on the device
            (async scheduling), its index in the previous step's samples; -1 otherwise.
        presence, frequency, repetition: float32 ``[P]`` penalties (0, 0, 1 = off).
        bias_index: int64 ``[B, 2]`` (row in ``[0, P)``, token id) of the ``logit_bias``
            entries; bias_value: float32 ``[B]``.
        allowed_index: int64 ``[A, 2]`` (row, token id) of the ``allowed_token_ids``;
            allowed_rows: int64 ``[R]`` rows that restrict their tokens.
    """

    index: np.ndarray
    tokens: np.ndarray
    num_prompt: np.ndarray
    num_tokens: np.ndarray
    pending: np.ndarray
    presence: np.ndarray
    frequency: np.ndarray
    repetition: np.ndarray
    bias_index: np.ndarray
    bias_value: np.ndarray
    allowed_index: np.ndarray
    allowed_rows: np.ndarray


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor,
                    output_counts: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Steps 3 and 4 of the module's formula, in place, as vLLM v1's ``apply_penalties``.

    Args:
        logits: ``[P, V]`` float logits, modified in place.
        prompt_mask: ``[P, V]`` bool, True where the token occurs in the prompt.
        output_counts: ``[P, V]`` counts (any real dtype) of each token in the output.
        presence, frequency, repetition: ``[P]`` penalties, logits' dtype.

    Returns:
        ``logits``.
    """
    output_mask = output_counts > 0
    rep = torch.where(prompt_mask | output_mask, repetition.unsqueeze(1),
                      torch.ones_like(logits))
    logits *= torch.where(logits > 0, 1.0 / rep, rep)
    logits -= frequency.unsqueeze(1) * output_counts.to(logits.dtype)
    logits -= presence.unsqueeze(1) * output_mask.to(logits.dtype)
    return logits


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(array)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def penalize_logits(logits: torch.Tensor, inputs: PenaltyInputs,
                    prev_sampled: torch.Tensor | None) -> torch.Tensor:
    """The logits to sample from: ``logits`` with the module's formula applied to the rows
    of ``inputs`` (a new float32 tensor; ``logits`` itself is left as is, for the raw
    log-probabilities).

    The rows' prompt masks and output counts are built on the device from their host
    tokens (one scatter each); an output token still on the device (async scheduling) is
    counted from ``prev_sampled`` there, so nothing waits for the previous step.

    Args:
        logits: ``[N, V]`` raw logits of the step's sampled rows.
        inputs: :class:`PenaltyInputs` of the rows that use a processor.
        prev_sampled: int64 ``[M]``, the previous step's samples on the device; needed when
            ``inputs.pending`` has an entry ``>= 0``.

    Returns:
        float32 ``[N, V]``.

    Raises:
        ValueError: a pending token without ``prev_sampled``.
    """
    device = logits.device
    n_rows, vocab = inputs.tokens.shape[0], logits.shape[1]
    index = _to(inputs.index, device)
    sub = logits.index_select(0, index).to(torch.float32)
    rows = _to(inputs.allowed_rows, device)
    if rows.numel():
        keep = torch.ones(n_rows, vocab, dtype=torch.bool, device=device)
        keep[rows] = False
        allowed = _to(inputs.allowed_index, device)
        keep[allowed[:, 0], allowed[:, 1]] = True
        sub.masked_fill_(~keep, float("-inf"))
    if inputs.bias_value.size:
        bias = _to(inputs.bias_index, device)
        sub.index_put_((bias[:, 0], bias[:, 1]), _to(inputs.bias_value, device),
                       accumulate=True)
    pen = inputs.presence.any() | inputs.frequency.any() | (inputs.repetition != 1.0).any()
    if pen:
        tokens = _to(inputs.tokens, device)
        pos = torch.arange(tokens.shape[1], device=device)
        n_prompt = _to(inputs.num_prompt, device).unsqueeze(1)
        in_prompt = pos < n_prompt
        pad = torch.full_like(tokens, vocab)
        counts = torch.zeros(n_rows, vocab + 1, dtype=torch.float32, device=device)
        prompt_mask = counts.clone().scatter_(1, torch.where(in_prompt, tokens, pad), 1.0)
        counts.scatter_add_(1, torch.where(in_prompt, pad, tokens), torch.ones_like(
            tokens, dtype=torch.float32))
        late = np.nonzero(inputs.pending >= 0)[0]
        if late.size:
            if prev_sampled is None:
                raise ValueError("a penalized row's last token is on the device but no "
                                 "previous samples were given")
            src = prev_sampled.index_select(0, _to(inputs.pending[late], device))
            counts.index_put_((_to(late.astype(np.int64), device), src),
                              torch.ones_like(src, dtype=torch.float32), accumulate=True)
        apply_penalties(sub, prompt_mask[:, :vocab] > 0, counts[:, :vocab],
                        _to(inputs.presence, device), _to(inputs.frequency, device),
                        _to(inputs.repetition, device))
    return logits.to(torch.float32).index_copy(0, index, sub)
