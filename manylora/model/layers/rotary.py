"""Rotary position embedding (RoPE, Su et al. 2021) with the scalings transformers defines.

The inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` (``linear``,
``llama3``, ``yarn``), so a checkpoint's ``rope_scaling`` / ``rope_parameters`` means
exactly what it means there. ``dynamic`` and ``longrope`` depend on the sequence length at
run time and are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE parameters, whichever transformers generation wrote them.

    Returns ``{"rope_type": ..., "rope_theta": ..., **scaling}``.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if not params and isinstance(scaling, dict):
        params = dict(scaling)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return params


def compute_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq float32 [head_dim // 2], attention_scaling)`` for the config.

    Raises:
        ValueError: a RoPE type whose frequencies change with the sequence length.
    """
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; manylora supports "
            f"{', '.join(_STATIC_ROPE_TYPES)}")
    if rope_type == "default":
        base = float(params["rope_theta"])
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base ** exponent), 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq.float(), float(scaling)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys by absolute position (the "rotate half" layout of HF).

    ``q' = q * cos(p θ) + rotate_half(q) * sin(p θ)``, with the cos/sin table in float32 for
    positions ``[0, max_position)``, cast to the activation dtype when applied; each product
    and the sum are rounded to the activation dtype, as in HF's ``apply_rotary_pos_emb``.

    CUDA tensors run one Triton launch for q and k together (vLLM's ``rotary_embedding`` op,
    ``manylora.ops.triton_fused``; CUDA-graph safe), others run PyTorch; both round the same
    way and both rotate q and k in place.

    Args:
        hf_config: the model's transformers config (for the RoPE type and its parameters).
        head_dim: rotary dimension (the full head).
        max_position: table length, positions.
    """

    def __init__(self, hf_config: Any, head_dim: int, max_position: int) -> None:
        super().__init__()
        inv_freq, scaling = compute_inv_freq(hf_config, head_dim)
        freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)                          # [P, D]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` and ``k`` in place and return them.

        Args:
            positions: int64 ``[T]``, each ``< max_position``, in any order.
            q: ``[T, Hq, D]``; k: ``[T, Hkv, D]``, same dtype; unit stride along ``D``, other
                strides free (the views of a packed qkv output are rotated where they lie).

        Returns:
            ``(q, k)``, the same tensors, rotated.
        """
        if q.is_cuda:
            from manylora.ops.triton_fused import rotary_embedding_triton

            return rotary_embedding_triton(positions, q, k, self.cos, self.sin)
        cos = self.cos.index_select(0, positions).to(q.dtype)[:, None, :]   # [T, 1, D]
        sin = self.sin.index_select(0, positions).to(q.dtype)[:, None, :]
        q.copy_(q * cos + _rotate_half(q) * sin)
        k.copy_(k * cos + _rotate_half(k) * sin)
        return q, k
