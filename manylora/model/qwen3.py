"""The Qwen3 decoder: the LLaMA-family decoder with a per-head q/k RMSNorm before RoPE.

Transformers' ``Qwen3Attention`` normalizes every query and key head after the projection
(``q_norm`` / ``k_norm``, one weight ``[head_dim]`` each, shared by the heads).
``head_dim`` is the config's, which may differ from ``hidden_size / heads``; the
projections carry a bias only with ``attention_bias`` (``ModelConfig.from_hf``).

Everything else, tensor parallelism and LoRA included, is ``LlamaForCausalLM``'s. The norm
weights are per head, so under tensor parallelism every rank holds the whole (replicated)
weights and normalizes its own heads. The norm runs inside ``rotate``, writing into the
packed ``qkv``, so the forward and the piecewise CUDA graphs (which keep ``qkv`` static)
both run it; the warm-up launches every RMSNorm at its own width.
"""

from __future__ import annotations

import torch

from manylora.config import ModelConfig
from manylora.distributed.parallel_state import TPGroup
from manylora.model.layers.norm import RMSNorm
from manylora.model.layers.qk_norm import rms_norm_heads_
from manylora.model.layers.rotary import RotaryEmbedding
from manylora.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class Qwen3Attention(LlamaAttention):
    """``LlamaAttention`` with ``q_norm`` and ``k_norm`` (``RMSNorm`` of width ``head_dim``,
    the checkpoint's ``self_attn.q_norm.weight`` / ``self_attn.k_norm.weight``)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 device: torch.device, tp: TPGroup) -> None:
        super().__init__(cfg, layer_idx, rotary, device, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype, device)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype, device)

    def rotate(self, positions: torch.Tensor, qkv: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``LlamaAttention.rotate`` after normalizing each query and key head of ``qkv``
        in place (``rms_norm_heads_``)."""
        cfg = self.cfg
        q, k, _ = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        rms_norm_heads_(self.q_norm, q, cfg.head_dim)
        rms_norm_heads_(self.k_norm, k, cfg.head_dim)
        return super().rotate(positions, qkv)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    """A Qwen3 causal LM: ``LlamaForCausalLM`` (its arguments, forward, LoRA slots and
    tensor parallelism) over ``Qwen3DecoderLayer`` layers, whose attention normalizes each
    query and key head before RoPE."""

    model_class = Qwen3Model
