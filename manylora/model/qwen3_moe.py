"""The Qwen3-MoE decoder (transformers' ``Qwen3MoeForCausalLM``; Qwen3-30B-A3B).

Qwen3's attention (per-head q/k RMSNorm before RoPE, ``Qwen3Attention``) over a MoE MLP
(``MoEDecoderLayer``): sparse layers as Qwen2-MoE decides them (``mlp_only_layers``,
``decoder_sparse_step``), each token routed to the top ``num_experts_per_tok`` of
``num_experts`` experts of ``moe_intermediate_size`` (softmax, renormalized with
``norm_topk_prob``); no shared expert. Dense layers are ``LlamaMLP`` of
``intermediate_size``.
"""

from __future__ import annotations

from manylora.model.llama import LlamaModel
from manylora.model.mixtral import MoEDecoderLayer, MoEForCausalLM
from manylora.model.qwen3 import Qwen3Attention


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3MoeModel(LlamaModel):
    layer_class = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """A Qwen3-MoE causal LM (``MoEForCausalLM`` over ``Qwen3MoeDecoderLayer``)."""

    model_class = Qwen3MoeModel
