"""Rotary position embedding (RoPE, Su et al. 2021) with the scalings transformers defines.

The inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` (``linear``,
``llama3``, ``yarn``, ``longrope``), so a checkpoint's ``rope_scaling`` / ``rope_parameters``
means exactly what it means there (``partial_rotary_factor`` included: only the first
``rotary_dim`` elements of each head rotate). ``dynamic`` depends on the sequence length at
run time and is refused.

``longrope`` (Phi-3's, named ``su`` in older configs) picks its frequencies by the sequence
length: transformers' ``longrope_frequency_update`` uses ``long_factor`` when the length
exceeds ``original_max_position_embeddings`` and ``short_factor`` otherwise (and Phi-3's
``generate`` computes a sequence again when it grows past that length, so that all its
keys rotate the long way). The table then holds both, ``[short rows; long rows]``, and each
token picks its half by its own sequence (``rope_rows``), so a batch may mix short and long
sequences (vLLM switches the whole batch at once).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ROPE_TYPES = (*_STATIC_ROPE_TYPES, "longrope")


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


def rotary_dim(hf_config: Any, head_dim: int) -> int:
    """The rotated width of each head: ``int(head_dim * partial_rotary_factor)`` (as
    transformers computes it; ``head_dim`` without the factor)."""
    factor = rope_parameters(hf_config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(hf_config, "partial_rotary_factor", 1.0)
    return int(head_dim * float(factor))


def compute_inv_freq(hf_config: Any, head_dim: int, long: bool = False
                     ) -> tuple[torch.Tensor, float]:
    """``(inv_freq float32 [rotary_dim // 2], attention_scaling)`` for the config
    (``rotary_dim(hf_config, head_dim)``); ``long``: ``longrope``'s long factors (a
    sequence longer than ``original_max_position_embeddings``), else its short ones.

    Raises:
        ValueError: a RoPE type whose frequencies change with the sequence length
            (``dynamic``) or that transformers does not define, naming it.
    """
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "su":
        rope_type = "longrope"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; manylora supports "
            f"{', '.join(_ROPE_TYPES)}")
    if rope_type == "default":
        dim = rotary_dim(hf_config, head_dim)
        base = float(params["rope_theta"])
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (base ** exponent), 1.0
    if rope_type == "longrope":
        seq_len = original_max_positions(hf_config) + 1 if long else None
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=seq_len)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq.float(), float(scaling)


def original_max_positions(hf_config: Any) -> int:
    """``longrope``'s ``original_max_position_embeddings`` (the pre-training length, past
    which a sequence uses the long factors): the config's top-level field first, as
    transformers reads Phi-3's, else the RoPE parameters', else ``max_position_embeddings``."""
    value = getattr(hf_config, "original_max_position_embeddings", None)
    if value is None:
        value = rope_parameters(hf_config).get("original_max_position_embeddings")
    if value is None:
        value = hf_config.max_position_embeddings
    return int(value)


def is_longrope(hf_config: Any) -> bool:
    """Whether the config's RoPE is ``longrope`` (or its older name ``su``)."""
    return rope_parameters(hf_config)["rope_type"] in ("longrope", "su")


def rope_rows(positions: np.ndarray, seq_lens: np.ndarray,
              long_rows: tuple[int, int]) -> np.ndarray:
    """The rows of a ``longrope`` table (``RotaryEmbedding.long_rows``) that tokens read.

    transformers rotates a sequence with the long factors once it holds more than
    ``original`` tokens, all of its keys included: Phi-3's ``generate`` drops the cache when
    the sequence grows past that length and computes it again
    (``Phi3ForCausalLM.prepare_inputs_for_generation``); the scheduler does the same
    (``Request.long_rope``). So a token reads the long rows exactly when its sequence holds
    more than ``original`` tokens (its prompt and the tokens generated so far, the one being
    computed included), whichever chunk it is computed in.

    Args:
        positions: int ``[T]``, each token's position in its sequence.
        seq_lens: int ``[T]``, the tokens each token's sequence holds.
        long_rows: ``(original_max_position_embeddings, offset of the long rows)``.

    Returns:
        int64 ``[T]``: ``p``, or ``p + offset`` for a token rotated with the long factors.
    """
    original, offset = long_rows
    return positions + offset * (seq_lens > original)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys by absolute position (the "rotate half" layout of HF).

    ``q' = q * cos(p θ) + rotate_half(q) * sin(p θ)`` over the first ``rotary_dim`` elements
    of each head (the rest pass unchanged, as in HF's ``apply_rotary_pos_emb``), with the
    cos/sin table in float32 for positions ``[0, max_position)``, cast to the activation
    dtype when applied; each product and the sum are rounded to the activation dtype, as in
    HF's ``apply_rotary_pos_emb``. A ``longrope`` table has ``2 * max_position`` rows: the
    short factors' then the long factors' (``long_rows``).

    CUDA tensors run one Triton launch for q and k together (vLLM's ``rotary_embedding`` op,
    ``manylora.ops.triton_fused``; CUDA-graph safe), others run PyTorch; both round the same
    way and both rotate q and k in place.

    Args:
        hf_config: the model's transformers config (for the RoPE type and its parameters).
        head_dim: the head width (``rotary_dim`` of it rotates).
        max_position: positions the table covers.

    Attributes:
        rotary_dim: the rotated width of each head (``partial_rotary_factor`` of
            ``head_dim``).
        long_rows: ``(original_max_position_embeddings, max_position)`` for ``longrope``:
            the length past which a sequence uses the long factors, and where their rows
            start (``rope_rows`` turns positions into rows); None for the other types, whose
            rows are the positions.

    Raises:
        ValueError: a RoPE type it does not support (``compute_inv_freq``).
    """

    def __init__(self, hf_config: Any, head_dim: int, max_position: int) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim(hf_config, head_dim)
        self.long_rows: tuple[int, int] | None = None
        tables = [compute_inv_freq(hf_config, head_dim)]
        if is_longrope(hf_config):
            self.long_rows = (original_max_positions(hf_config), max_position)
            tables.append(compute_inv_freq(hf_config, head_dim, long=True))
        pos = torch.arange(max_position, dtype=torch.int64).float()[:, None]
        emb = [torch.cat((pos * f[None], pos * f[None]), dim=-1) for f, _ in tables]
        cos = [e.cos() * scaling for e, (_, scaling) in zip(emb, tables)]
        sin = [e.sin() * scaling for e, (_, scaling) in zip(emb, tables)]
        self.register_buffer("cos", torch.cat(cos), persistent=False)        # [rows, rd]
        self.register_buffer("sin", torch.cat(sin), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` and ``k`` in place and return them.

        Args:
            positions: int64 ``[T]``, rows of the table in any order: each token's position
                (``< max_position``), or for ``longrope`` its ``rope_rows`` row.
            q: ``[T, Hq, D]``; k: ``[T, Hkv, D]``, same dtype; unit stride along ``D``, other
                strides free (the views of a packed qkv output are rotated where they lie).

        Returns:
            ``(q, k)``, the same tensors, rotated.
        """
        rd = self.rotary_dim
        qr, kr = (q, k) if rd == q.shape[-1] else (q[..., :rd], k[..., :rd])
        if q.is_cuda:
            from manylora.ops.triton_fused import rotary_embedding_triton

            rotary_embedding_triton(positions, qr, kr, self.cos, self.sin)
            return q, k
        cos = self.cos.index_select(0, positions).to(q.dtype)[:, None, :]   # [T, 1, rd]
        sin = self.sin.index_select(0, positions).to(q.dtype)[:, None, :]
        qr.copy_(qr * cos + _rotate_half(qr) * sin)
        kr.copy_(kr * cos + _rotate_half(kr) * sin)
        return q, k
