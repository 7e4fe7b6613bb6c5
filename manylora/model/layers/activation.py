"""Gated activations of the MLP: SiLU-and-mul (the LLaMA MLP's SwiGLU, Shazeer 2020) and
GELU(tanh)-and-mul (Gemma's GeGLU)."""

from __future__ import annotations

import torch
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the packed ``gate_up_proj`` output; vLLM's ``silu_and_mul``.

    Rounds as HF's ``LlamaMLP`` (``act_fn(gate_proj(x)) * up_proj(x)``): ``silu(g) =
    g / (1 + exp(-g))`` computed in float32 and rounded to the dtype, then the product with
    ``up`` rounded to the dtype.

    CUDA tensors run one Triton launch (``manylora.ops.triton_fused``, CUDA-graph safe);
    others run PyTorch.

    Args:
        x: ``[T, 2 * I]``, gate columns first, then up.

    Returns:
        ``[T, I]`` in ``x.dtype``.
    """
    if x.is_cuda:
        from manylora.ops.triton_fused import silu_and_mul_triton

        return silu_and_mul_triton(x)
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


class SiluAndMul(nn.Module):
    """Module form of :func:`silu_and_mul`: ``[T, 2 * I] → [T, I]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` of the packed ``gate_up_proj`` output (GeGLU, Gemma's MLP with
    ``hidden_activation`` ``gelu_pytorch_tanh``); vLLM's ``gelu_tanh_and_mul``.

    Rounds as transformers' ``Gemma2MLP`` (``act_fn(gate_proj(x)) * up_proj(x)`` with
    ``gelu(approximate="tanh")``): the activation rounded to the dtype, then the product.
    PyTorch on every device.

    Args:
        x: ``[T, 2 * I]``, gate columns first, then up.

    Returns:
        ``[T, I]`` in ``x.dtype``.
    """
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.gelu(gate, approximate="tanh") * up
