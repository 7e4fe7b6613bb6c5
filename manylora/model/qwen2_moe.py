"""The Qwen2-MoE decoder (transformers' ``Qwen2MoeForCausalLM``; Qwen1.5-MoE).

Qwen2's attention (q/k/v bias) over a MoE MLP (``MoEDecoderLayer``): layer ``i`` is sparse
unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (then a dense
``LlamaMLP`` of ``intermediate_size``). The sparse block routes each token to the top
``num_experts_per_tok`` of ``num_experts`` experts of ``moe_intermediate_size`` (softmax,
renormalized only with ``norm_topk_prob``) and adds the shared expert (a dense MLP of
``shared_expert_intermediate_size``) times ``sigmoid(shared_expert_gate(x))``.
"""

from __future__ import annotations

from manylora.model.llama import LlamaModel
from manylora.model.mixtral import MoEDecoderLayer, MoEForCausalLM


class Qwen2MoeModel(LlamaModel):
    layer_class = MoEDecoderLayer


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """A Qwen2-MoE causal LM (``MoEForCausalLM`` over ``MoEDecoderLayer``)."""

    model_class = Qwen2MoeModel
