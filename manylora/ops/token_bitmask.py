"""Token bitmasks on logits (structured output): the constrained rows' disallowed tokens
become ``-inf`` in one batched operation per step.

``bitmask`` is int32 ``[k, 1 + W]`` (``W = ceil(V / 32)``): row ``r`` names the logits row
``bitmask[r, 0]`` it constrains and holds its bitmask in ``bitmask[r, 1:]`` (xgrammar's
layout: bit ``j % 32`` of word ``j // 32`` set ⇔ token ``j`` allowed)::

    logits[bitmask[r, 0], j] = -inf   if (bitmask[r, 1 + j // 32] >> (j % 32)) & 1 == 0
                                     for r < k, j < V; every other element unchanged

CUDA tensors run the Triton kernel (``ops/triton_token_bitmask.py``, one launch), others
the PyTorch reference below.
"""

from __future__ import annotations

import torch

__all__ = ["apply_token_bitmask_", "token_bitmask_reference_"]


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Mask ``logits`` in place per ``bitmask`` (the module's formula) and return it.

    Args:
        logits: float32 ``[N, V]``, contiguous rows.
        bitmask: int32 ``[k, 1 + ceil(V / 32)]`` on ``logits``' device; ``0 <= bitmask[:, 0]
            < N``, each row at most once.

    Raises:
        ValueError: a dtype, device or width that does not fit.
    """
    if bitmask.dtype != torch.int32 or bitmask.device != logits.device:
        raise ValueError(f"bitmask must be int32 on {logits.device}, got {bitmask.dtype} on "
                         f"{bitmask.device}")
    vocab = logits.shape[1]
    if bitmask.shape[1] != 1 + -(-vocab // 32):
        raise ValueError(f"bitmask has {bitmask.shape[1]} columns; logits of {vocab} tokens "
                         f"need {1 + -(-vocab // 32)}")
    if bitmask.shape[0] == 0:
        return logits
    if logits.is_cuda:
        from manylora.ops.triton_token_bitmask import apply_token_bitmask_triton

        apply_token_bitmask_triton(logits, bitmask)
        return logits
    return token_bitmask_reference_(logits, bitmask)


def token_bitmask_reference_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The PyTorch reference of ``apply_token_bitmask_`` (any device): the words' bits
    unpacked to ``[k, 32 W]`` booleans, the rows gathered, masked and scattered back."""
    vocab = logits.shape[1]
    rows = bitmask[:, 0].long()
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, 1:, None] >> shifts) & 1
    banned = bits.flatten(1)[:, :vocab] == 0
    logits[rows] = logits[rows].masked_fill(banned, float("-inf"))
    return logits
