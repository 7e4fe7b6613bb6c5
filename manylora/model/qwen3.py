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

from manylora.model.layers.norm import RMSNorm
from manylora.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class Qwen3Attention(LlamaAttention):
    """``LlamaAttention`` with ``q_norm`` and ``k_norm`` (``RMSNorm`` of width ``head_dim``,
    the checkpoint's ``self_attn.q_norm.weight`` / ``self_attn.k_norm.weight``) on each query
    and key head before RoPE."""

    qk_norm_class = RMSNorm


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    """A Qwen3 causal LM: ``LlamaForCausalLM`` (its arguments, forward, LoRA slots and
    tensor parallelism) over ``Qwen3DecoderLayer`` layers, whose attention normalizes each
    query and key head before RoPE."""

    model_class = Qwen3Model
