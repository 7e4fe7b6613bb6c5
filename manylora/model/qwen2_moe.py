"""The Qwen2-MoE decoder (transformers' ``Qwen2MoeForCausalLM``; Qwen1.5-MoE).

Qwen2's attention (q/k/v bias) over a MoE MLP (``MoEDecoderLayer``): layer ``i`` is sparse
unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (then a dense
``LlamaMLP`` of ``intermediate_size``). The sparse block routes each token to the top
``num_experts_per_tok`` of ``num_experts`` experts of ``moe_intermediate_size`` (softmax,
renormalized only with ``norm_topk_prob``) and adds the shared expert (a dense MLP of
``shared_expert_intermediate_size``) times ``sigmoid(shared_expert_gate(x))``.
"""

from __future__ import annotations

import torch
from torch import nn

from manylora.config import ModelConfig
from manylora.distributed.parallel_state import TPGroup
from manylora.model.layers.moe import FusedMoE
from manylora.model.llama import LlamaModel
from manylora.model.mixtral import MoEDecoderLayer, MoEForCausalLM, dense_mlp


def is_sparse_layer(hf_config, layer_idx: int) -> bool:
    """Whether Qwen2-MoE / Qwen3-MoE layer ``layer_idx`` has experts, as transformers
    decides it (``mlp_only_layers``, ``decoder_sparse_step``, ``num_experts > 0``)."""
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(hf_config, "mlp_only_layers", None) or [])
            and hf_config.num_experts > 0 and (layer_idx + 1) % step == 0)


class Qwen2MoeDecoderLayer(MoEDecoderLayer):
    def make_block(self, cfg: ModelConfig, layer_idx: int, device: torch.device,
                   tp: TPGroup) -> nn.Module:
        """A ``FusedMoE`` with the shared expert on sparse layers, else a dense MLP."""
        hf = cfg.hf_config
        if not is_sparse_layer(hf, layer_idx):
            return dense_mlp(cfg, layer_idx, device, tp)
        shared = dense_mlp(cfg, layer_idx, device, tp, hf.shared_expert_intermediate_size,
                           "mlp.shared_expert")
        return FusedMoE(cfg.hidden_size, hf.num_experts, hf.moe_intermediate_size,
                        hf.num_experts_per_tok, bool(hf.norm_topk_prob), cfg.dtype, device, tp,
                        shared_expert=shared)


class Qwen2MoeModel(LlamaModel):
    layer_class = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """A Qwen2-MoE causal LM (``MoEForCausalLM`` over ``Qwen2MoeDecoderLayer``)."""

    model_class = Qwen2MoeModel
