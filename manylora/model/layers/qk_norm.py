"""Query/key RMSNorm per head after the projection and before RoPE (Qwen3's and Gemma 3's
``q_norm`` / ``k_norm``; ``LlamaAttention.qk_norm_class``).

As transformers applies it: each head's vector normalized on its own, one weight
``[head_dim]`` shared by all heads, so under tensor parallelism every rank holds it whole."""

from __future__ import annotations

import torch

from manylora.model.layers.norm import RMSNorm


def rms_norm_heads_(norm: RMSNorm, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Normalize every ``head_dim``-wide head of ``x`` with ``norm`` (one weight ``[head_dim]``
    shared by all heads), in place.

    Rounds as transformers' ``Qwen3RMSNorm`` on ``x.view(T, H, head_dim)`` (``RMSNorm``: the
    statistic in float32, the product with the weight in ``x``'s dtype). Writing back into
    ``x`` keeps the packed ``qkv`` the piecewise CUDA graphs hold static.

    Args:
        norm: an ``RMSNorm`` of width ``head_dim``.
        x: ``[T, H * head_dim]``, any row stride with unit stride along the last dimension
            (the q or k view of the packed ``qkv``).
        head_dim: the head width.

    Returns:
        ``x``, normalized.
    """
    heads = x.view(x.shape[0], -1, head_dim)                          # [T, H, D]
    heads.copy_(norm(heads))
    return x
