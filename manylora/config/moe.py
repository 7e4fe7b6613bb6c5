"""The mixture-of-experts shape of a decoder config (``MoEShape``): which layers are sparse,
how many experts each has and how wide they are, as transformers' Mixtral, Qwen2-MoE and
Qwen3-MoE read their configs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: ``model_type``s whose sparse layers are chosen by ``mlp_only_layers`` and
#: ``decoder_sparse_step`` (transformers' Qwen2-MoE / Qwen3-MoE decoder layers).
_QWEN_MOE = ("qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class MoEShape:
    """The experts of a MoE decoder, whole (not cut for tensor parallelism).

    Attributes:
        num_experts: ``E``, experts per sparse layer.
        top_k: experts each token is routed to.
        intermediate_size: each expert's ``I`` (``moe_intermediate_size``; Mixtral's
            ``intermediate_size``).
        sparse_layers: the layers whose MLP is the MoE block, ascending.
        shared_expert_size: Qwen2-MoE's shared expert's intermediate width; 0 without one.
        renormalize: whether the top-k routing weights are scaled to sum to 1.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    sparse_layers: tuple[int, ...]
    shared_expert_size: int = 0
    renormalize: bool = True


def is_sparse_layer(hf_config: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` of a Qwen2-MoE / Qwen3-MoE config has experts, as
    transformers decides it (``mlp_only_layers``, ``decoder_sparse_step``,
    ``num_experts > 0``); every layer of a Mixtral config does."""
    if getattr(hf_config, "model_type", "") not in _QWEN_MOE:
        return True
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(hf_config, "mlp_only_layers", None) or [])
            and hf_config.num_experts > 0 and (layer_idx + 1) % step == 0)


def moe_shape(hf_config: Any) -> MoEShape | None:
    """The ``MoEShape`` of a Mixtral / Qwen2-MoE / Qwen3-MoE config, None for a dense one."""
    model_type = getattr(hf_config, "model_type", "")
    layers = range(hf_config.num_hidden_layers)
    if model_type == "mixtral":
        return MoEShape(hf_config.num_local_experts, hf_config.num_experts_per_tok,
                        hf_config.intermediate_size, tuple(layers))
    if model_type in _QWEN_MOE:
        sparse = tuple(i for i in layers if is_sparse_layer(hf_config, i))
        shared = (getattr(hf_config, "shared_expert_intermediate_size", 0) or 0
                  if model_type == "qwen2_moe" else 0)
        return MoEShape(hf_config.num_experts, hf_config.num_experts_per_tok,
                        hf_config.moe_intermediate_size, sparse, shared,
                        bool(hf_config.norm_topk_prob))
    return None
