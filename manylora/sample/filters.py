"""The sampler's filters on temperature-scaled logits: top-k, top-p (one ascending sort, as
vLLM's ``apply_top_k_top_p``) and min-p. Masked logits become ``-inf``."""

from __future__ import annotations

import torch


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
