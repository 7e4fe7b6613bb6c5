"""The Granite decoder (``GraniteForCausalLM``, IBM Granite 3.x dense): the LLaMA-family
decoder with the embedding, residual, attention and logits multipliers of its config.

The four scalars, as transformers' ``GraniteModel`` applies them::

    h = embed_tokens(ids) * embedding_multiplier
    h = h + o_proj(attention(...)) * residual_multiplier     # softmax scale attention_multiplier
    h = h + mlp(post_attention_layernorm(h)) * residual_multiplier
    logits = lm_head(norm(h)) / logits_scaling

``attention_multiplier`` replaces ``1 / sqrt(head_dim)`` as the scale of ``q·k``. Each
sublayer's output is multiplied before the residual add, which stays fused into the next
RMSNorm (``h = x + residual`` inside the norm, with ``x`` the multiplied output: the same
rounding as transformers' ``residual + x * residual_multiplier``), so the layer keeps
``LlamaDecoderLayer``'s methods and the residual convention the piecewise CUDA graphs and
the warm-up cut along. The scaled embedding and the divided logits run in ``embed`` and
``compute_logits``, which the graphs and the model runner call.

Projections, RoPE, tensor parallelism and LoRA targets are ``LlamaForCausalLM``'s (vLLM's
``GraniteForCausalLM`` is its Llama with the same four scalars).
"""

from __future__ import annotations

from typing import Any

import torch

from manylora.config import ModelConfig
from manylora.distributed.parallel_state import TPGroup
from manylora.lora.kernels.meta import LoRAKernelMeta
from manylora.model.layers.rotary import RotaryEmbedding
from manylora.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class GraniteAttention(LlamaAttention):
    """``LlamaAttention`` whose softmax scale is the config's ``attention_multiplier``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 device: torch.device, tp: TPGroup) -> None:
        super().__init__(cfg, layer_idx, rotary, device, tp)
        self.scale = float(cfg.hf_config.attention_multiplier)


class GraniteDecoderLayer(LlamaDecoderLayer):
    """``LlamaDecoderLayer`` whose attention and MLP outputs are multiplied by the config's
    ``residual_multiplier`` before they join the residual stream."""

    attention_class = GraniteAttention

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 device: torch.device, tp: TPGroup) -> None:
        super().__init__(cfg, layer_idx, rotary, device, tp)
        self.residual_multiplier = float(cfg.hf_config.residual_multiplier)

    def post_attention(self, o: torch.Tensor, residual: torch.Tensor,
                       lora: LoRAKernelMeta | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention output [T, q_size], residual) → (mlp output * residual_multiplier,
        residual stream before it)``: ``o_proj`` (+ LoRA; all-reduced) times
        ``residual_multiplier``, the post-attention norm with the residual add fused, the MLP
        (+ LoRA) times ``residual_multiplier``; the next norm adds the two."""
        x = self.self_attn.o_proj(o, lora) * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, lora) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    layer_class = GraniteDecoderLayer


class GraniteForCausalLM(LlamaForCausalLM):
    """A Granite causal LM: ``LlamaForCausalLM`` (its arguments, forward, LoRA slots and
    tensor parallelism) over ``GraniteDecoderLayer`` layers, with the embedding multiplied
    by ``embedding_multiplier`` and the logits divided by ``logits_scaling`` (the config's,
    transformers' ``GraniteConfig``). Adapters target the same seven projections as on
    LLaMA."""

    model_class = GraniteModel

    def __init__(self, cfg: ModelConfig, device: torch.device, tp: TPGroup | None = None) -> None:
        super().__init__(cfg, device, tp)
        self.embedding_multiplier = float(cfg.hf_config.embedding_multiplier)
        self.logits_scaling = float(cfg.hf_config.logits_scaling)

    def embed(self, input_ids: torch.Tensor, lora: LoRAKernelMeta | None = None
              ) -> torch.Tensor:
        """int64 ``[T]`` token ids → ``[T, hidden]`` in the model dtype: the embedding
        (``embed_tokens`` adapters of ``lora`` included) times ``embedding_multiplier``."""
        return super().embed(input_ids, lora) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``LlamaForCausalLM.compute_logits`` (same arguments; float32 ``[N, vocab]``)
        divided by ``logits_scaling``, in float32 (transformers divides in the model dtype:
        the same logits in float32, closer to the exact quotient in bf16)."""
        return super().compute_logits(hidden, *args, **kwargs) / self.logits_scaling
