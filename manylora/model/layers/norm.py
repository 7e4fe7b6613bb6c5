"""RMSNorm (Zhang & Sennrich, 2019), computed as LLaMA does in transformers."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``y = w * (x / sqrt(mean(x^2) + eps))``, the statistic in float32.

    Args:
        hidden_size: width of the last dimension.
        eps: added to the mean square.
        dtype, device: of the weight.

    Shapes: ``x [T, hidden_size]`` in the model dtype → same shape and dtype.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
