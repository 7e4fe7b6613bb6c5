"""The Mixtral decoder and the mixture-of-experts decoder base the MoE families share.

A MoE decoder layer is the LLaMA-family layer whose MLP is a ``FusedMoE`` block (router,
stacked experts, optional shared expert; ``manylora.model.layers.moe``) on its sparse
layers and a dense ``LlamaMLP`` on the others. Attention, norms, tensor parallelism and the
piecewise CUDA graphs' methods are ``LlamaDecoderLayer``'s. Adapters reach the attention
projections, the dense layers' MLPs and, where ``lora_target_modules`` names them, the MoE
block's experts, router and shared expert (``manylora.model.layers.moe``). Quantized MoE
bases are refused.

Mixtral (transformers' ``MixtralForCausalLM``): every layer sparse, block named
``block_sparse_moe``, softmax over ``num_local_experts`` then the top
``num_experts_per_tok`` renormalized; Mistral's attention (one ``sliding_window`` for every
layer when the config sets one).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from manylora.config import LoRAConfig, ModelConfig
from manylora.config.quantization import QuantizationError
from manylora.distributed.parallel_state import TPGroup
from manylora.lora.kernels.meta import LoRAKernelMeta
from manylora.lora.linear import LoRALinear
from manylora.lora.slot_table import SlotColumns
from manylora.model.layers.moe import FusedMoE
from manylora.model.layers.rotary import RotaryEmbedding
from manylora.model.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    layer_prefix,
)


class MoEDecoderLayer(LlamaDecoderLayer):
    """``LlamaDecoderLayer`` whose MLP is ``make_block``'s: a ``FusedMoE`` (stored as
    ``block_name``) on sparse layers, a ``LlamaMLP`` (``mlp``) on dense ones."""

    #: The attribute (and checkpoint module name) of the MoE block.
    block_name = "mlp"

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 device: torch.device, tp: TPGroup) -> None:
        nn.Module.__init__(self)
        self.self_attn = self.attention_class(cfg, layer_idx, rotary, device, tp)
        block = self.make_block(cfg, layer_idx, device, tp)
        self.block_attr = self.block_name if isinstance(block, FusedMoE) else "mlp"
        setattr(self, self.block_attr, block)
        self.input_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype,
                                               device)
        self.post_attention_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps,
                                                        cfg.dtype, device)

    @property
    def block(self) -> nn.Module:
        """The layer's MLP: its ``FusedMoE`` or its dense ``LlamaMLP``."""
        return getattr(self, self.block_attr)

    def make_block(self, cfg: ModelConfig, layer_idx: int, device: torch.device,
                   tp: TPGroup) -> nn.Module:
        """A ``FusedMoE`` of the config's experts on its sparse layers (``cfg.moe``: every
        layer of Mixtral), with the shared expert where it has one, else a dense MLP."""
        moe = cfg.moe
        if layer_idx not in moe.sparse_layers:
            return dense_mlp(cfg, layer_idx, device, tp)
        shared = None
        if moe.shared_expert_size:
            shared = dense_mlp(cfg, layer_idx, device, tp, moe.shared_expert_size,
                               "mlp.shared_expert", "shared_expert.")
        return FusedMoE(cfg.hidden_size, moe, cfg.dtype, device, tp, shared_expert=shared)

    def post_attention(self, o: torch.Tensor, residual: torch.Tensor,
                       lora: LoRAKernelMeta | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``LlamaDecoderLayer.post_attention`` with the layer's block as the MLP."""
        x = self.self_attn.o_proj(o, lora)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.block(x, lora), residual


class MixtralDecoderLayer(MoEDecoderLayer):
    block_name = "block_sparse_moe"


class MixtralModel(LlamaModel):
    layer_class = MixtralDecoderLayer


class MoEForCausalLM(LlamaForCausalLM):
    """A MoE causal LM: ``LlamaForCausalLM`` (its arguments, forward, LoRA slots on the
    attention projections, tensor parallelism) over ``MoEDecoderLayer`` layers.

    Raises:
        QuantizationError: ``cfg.quantization`` set (MoE experts are not quantized yet).
        ValueError: as ``LlamaForCausalLM``; an expert width not divisible by the ranks.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device, tp: TPGroup | None = None) -> None:
        if cfg.quantization is not None:
            raise QuantizationError(
                f"{cfg.architecture} is a mixture-of-experts model: manylora does not serve "
                f"its experts quantized ({cfg.quantization.name}); use an unquantized "
                "checkpoint")
        super().__init__(cfg, device, tp)

    def _projections(self, layer: int) -> tuple[LoRALinear, ...]:
        layer_mod = self.model.layers[layer]
        attn = (layer_mod.self_attn.qkv_proj, layer_mod.self_attn.o_proj)
        if isinstance(layer_mod.block, LlamaMLP):
            return attn + (layer_mod.block.gate_up_proj, layer_mod.block.down_proj)
        return attn + layer_mod.block.projections()

    def _create_layer_lora(self, layer: int, lora_config: LoRAConfig
                           ) -> dict[tuple[int, str], SlotColumns]:
        """The experts' slot buffers of a sparse layer, keyed by the expert modules
        ``lora_config.target_modules`` names."""
        block = self.model.layers[layer].block
        if not isinstance(block, FusedMoE):
            return {}
        slots = block.create_lora_slots(lora_config.target_modules, lora_config.max_loras,
                                        lora_config.max_lora_rank, lora_config.dtype)
        return {} if slots is None else {(layer, m): slots for m in slots.module_names}


class MixtralForCausalLM(MoEForCausalLM):
    """A Mixtral causal LM (``MoEForCausalLM`` over ``MixtralDecoderLayer``)."""

    model_class = MixtralModel


def dense_mlp(cfg: ModelConfig, layer_idx: int, device: torch.device, tp: TPGroup,
              intermediate_size: int | None = None, prefix: str = "mlp",
              lora_prefix: str = "") -> LlamaMLP:
    """A ``LlamaMLP`` of ``intermediate_size`` (default the config's) at checkpoint module
    ``model.layers.{layer_idx}.{prefix}``, its LoRA modules named ``lora_prefix +
    "gate_proj"`` etc."""
    if intermediate_size is not None:
        cfg = dataclasses.replace(cfg, intermediate_size=intermediate_size,
                                  total_intermediate_size=intermediate_size)
    return LlamaMLP(cfg, device, tp, f"{layer_prefix(layer_idx)}.{prefix}", lora_prefix)
