"""The Gemma 2 decoder (``Gemma2ForCausalLM``): LLaMA's projections and RoPE with Gemma's
norms, GeGLU, scaled embedding, query scale and soft-capping.

As transformers' ``Gemma2Model`` computes it::

    h = embed(ids) * normalizer          # normalizer = sqrt(hidden), rounded to the dtype
    per layer:
        h = h + post_attention_layernorm(o_proj(attention(input_layernorm(h))))
        h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
    logits = cap_f * tanh(lm_head(norm(h)) / cap_f)     # final_logit_softcapping

Every norm is ``GemmaRMSNorm`` (``(1 + w)``, float32 throughout); the MLP is GeGLU
(``gelu_pytorch_tanh``); attention scales by ``query_pre_attn_scalar ** -0.5`` and caps its
logits at ``attn_logit_softcapping`` (``paged_attention``'s ``softcap``); ``layer_types``
alternates sliding-window layers (``sliding_window``: a query sees itself and the
``sliding_window - 1`` keys before it, as transformers' mask) with global ones
(``ModelConfig.sliding_windows``). Embeddings are tied by default. The final soft cap runs
in float32 on the gathered logits (transformers caps in the model dtype; float32 models
match exactly).

The layer keeps ``LlamaDecoderLayer``'s methods and the residual convention the piecewise
CUDA graphs and the warm-up cut along (``pre_attention`` → ``self_attn.rotate`` →
``self_attn.attend`` → ``post_attention``; a layer hands on ``(x, residual)`` whose sum is
the residual stream), as OLMo 2's does. Tensor parallelism and LoRA are LLaMA's: adapters
target the same seven projections by peft's names.
"""

from __future__ import annotations

import torch

from manylora.config import ModelConfig
from manylora.distributed.parallel_state import TPGroup
from manylora.lora.kernels.meta import LoRAKernelMeta
from manylora.model.layers.activation import gelu_tanh_and_mul
from manylora.model.layers.norm import GemmaRMSNorm
from manylora.model.layers.rotary import RotaryEmbedding
from manylora.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)

#: The activations transformers' Gemma MLP may name that GeGLU here computes.
_GELU_TANH = ("gelu_pytorch_tanh",)


class Gemma2Attention(LlamaAttention):
    """``LlamaAttention`` scaled by ``query_pre_attn_scalar ** -0.5`` with its logits
    soft-capped at ``attn_logit_softcapping`` (None: uncapped)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 device: torch.device, tp: TPGroup) -> None:
        super().__init__(cfg, layer_idx, rotary, device, tp)
        hf = cfg.hf_config
        self.scale = float(hf.query_pre_attn_scalar) ** -0.5
        self.softcap = self.logit_softcap(hf)

    @staticmethod
    def logit_softcap(hf_config) -> float | None:
        """The attention logits' cap transformers applies for this family's config."""
        cap = getattr(hf_config, "attn_logit_softcapping", None)
        return float(cap) if cap else None


class Gemma2MLP(LlamaMLP):
    """``LlamaMLP`` with GeGLU: ``down_proj(gelu_tanh(gate) * up)``.

    Raises:
        ValueError: a ``hidden_activation`` other than ``gelu_pytorch_tanh``.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device, tp: TPGroup,
                 prefix: str = "mlp") -> None:
        act = getattr(cfg.hf_config, "hidden_activation", None) or getattr(
            cfg.hf_config, "hidden_act", None)
        if act not in _GELU_TANH:
            raise ValueError(f"hidden_activation {act!r} is not supported for "
                             f"{cfg.architecture}; manylora computes {', '.join(_GELU_TANH)}")
        super().__init__(cfg, device, tp, prefix)

    def forward(self, x: torch.Tensor, lora: LoRAKernelMeta | None) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x, lora)), lora)


class Gemma2DecoderLayer(LlamaDecoderLayer):
    """``LlamaDecoderLayer`` (its ``pre_attention``) with Gemma's attention, GeGLU and
    ``(1 + w)`` norms, and norms before and after the MLP too."""

    attention_class = Gemma2Attention
    mlp_class = Gemma2MLP
    norm_class = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 device: torch.device, tp: TPGroup) -> None:
        super().__init__(cfg, layer_idx, rotary, device, tp)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                      cfg.dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                       cfg.dtype, device)

    def post_attention(self, o: torch.Tensor, residual: torch.Tensor,
                       lora: LoRAKernelMeta | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention output [T, q_size], h) → (post_feedforward_layernorm(mlp(
        pre_feedforward_layernorm(h'))), h')`` with ``h' = h +
        post_attention_layernorm(o_proj(o))`` (``o_proj`` all-reduced); the next layer (or
        ``final_norm``) adds the two."""
        h = residual + self.post_attention_layernorm(self.self_attn.o_proj(o, lora))
        x = self.mlp(self.pre_feedforward_layernorm(h), lora)
        return self.post_feedforward_layernorm(x), h


class Gemma2Model(LlamaModel):
    layer_class = Gemma2DecoderLayer
    norm_class = GemmaRMSNorm


class Gemma2ForCausalLM(LlamaForCausalLM):
    """A Gemma 2 causal LM: ``LlamaForCausalLM``'s interface, tensor parallelism, LoRA slots
    and methods (shapes, errors) over ``Gemma2Model``'s layers, with the embedding scaled
    by ``sqrt(hidden_size)`` and the logits soft-capped at ``final_logit_softcapping``.

    Raises:
        ValueError: as ``LlamaForCausalLM``, or a ``hidden_activation`` other than
            ``gelu_pytorch_tanh``.
    """

    model_class = Gemma2Model

    def __init__(self, cfg: ModelConfig, device: torch.device, tp: TPGroup | None = None) -> None:
        super().__init__(cfg, device, tp)
        # transformers keeps sqrt(hidden) as a float32 buffer and casts it to the dtype
        self.normalizer = float(torch.tensor(cfg.hidden_size ** 0.5).to(cfg.dtype))
        cap = getattr(cfg.hf_config, "final_logit_softcapping", None)
        self.final_softcap = float(cap) if cap else None

    def embed(self, input_ids: torch.Tensor, lora: LoRAKernelMeta | None = None
              ) -> torch.Tensor:
        """int64 ``[T]`` → ``LlamaForCausalLM.embed(ids, lora) * normalizer``, ``[T, hidden]`` in
        the model dtype (all-reduced under tensor parallelism). Whatever the inherited
        embedding adds is scaled with it, as peft scales an embedding adapter's output by
        the base layer's ``embed_scale``."""
        return super().embed(input_ids, lora) * self.normalizer

    def compute_logits(self, hidden: torch.Tensor, rows: LoRAKernelMeta | None = None
                       ) -> torch.Tensor:
        """``LlamaForCausalLM.compute_logits`` (float32 ``[N, vocab]``, ``lm_head`` adapters
        of ``rows`` included), then ``cap * tanh(logits / cap)`` when the config has a
        ``final_logit_softcapping``."""
        logits = super().compute_logits(hidden, rows)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap
