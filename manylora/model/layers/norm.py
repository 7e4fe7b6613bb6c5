"""RMSNorm (Zhang & Sennrich, 2019), computed as LLaMA does in transformers, and Gemma's
``(1 + w)`` variant."""

from __future__ import annotations

from typing import overload

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``y = w * (x / sqrt(mean(x^2) + eps))``, the statistic in float32.

    Rounds as HF's ``LlamaRMSNorm``: normalize in float32, cast to the activation dtype, then
    multiply by the weight in that dtype. With a residual it is vLLM's ``fused_add_rms_norm``:
    the residual add and the norm in one step.

    CUDA tensors run one Triton launch per call (``manylora.ops.triton_fused``, no host sync,
    CUDA-graph safe); others run the PyTorch code below. Both round identically; the float32
    statistic may differ in its last bits (summation order), see ``triton_fused``.

    Args:
        hidden_size: width of the last dimension.
        eps: added to the mean square.
        dtype, device: of the weight.

    Shapes: ``x [T, hidden_size]`` in the model dtype → same shape and dtype.
    """

    #: Scale by ``1 + weight`` in float32 (Gemma's norm; the kernels' ``UNIT_OFFSET``).
    unit_offset: bool = False

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.eps = eps

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor,
                residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize ``x``, or ``x + residual``.

        Args:
            x: ``[T, hidden_size]``.
            residual: optional ``[T, hidden_size]``, dtype of ``x``.

        Returns:
            Without ``residual``: ``weight * rms_normalize(x.float()).to(x.dtype)``. With it:
            ``(out, new_residual)`` where ``new_residual = x + residual`` (rounded to the
            dtype, as a PyTorch add) and ``out`` is the norm of ``new_residual``; both are new
            tensors, neither input is modified.
        """
        if x.is_cuda:
            from manylora.ops import triton_fused

            if residual is None:
                return triton_fused.rms_norm_triton(x, self.weight, self.eps,
                                                    unit_offset=self.unit_offset)
            return triton_fused.fused_add_rms_norm_triton(x, residual, self.weight, self.eps,
                                                          unit_offset=self.unit_offset)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * (1 + w)``, all in float32, then cast.

    Rounds as transformers' ``Gemma2RMSNorm`` / ``Gemma3RMSNorm``: normalize ``x.float()``,
    multiply by ``1 + weight.float()``, cast to ``x``'s dtype once (``RMSNorm`` casts before
    the product instead). The checkpoint stores ``w`` (zero-centred). With a residual it
    adds first, as ``RMSNorm`` does. CUDA tensors run ``RMSNorm``'s Triton launch with
    ``unit_offset`` (``manylora.ops.triton_fused``; CUDA-graph safe); others run PyTorch.
    Arguments as ``RMSNorm``'s.

    Shapes: ``x [..., hidden_size]`` → same shape and dtype; with ``residual`` (same shape
    and dtype) ``(norm(x + residual), x + residual)``, the sum rounded to the dtype.
    """

    unit_offset = True

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
