"""TensorRT-LLM's LoRA module ids (its ``LoraModuleType``) and how they map to the HF
projections of the LLaMA family, as its ``examples/hf_lora_convert.py`` maps them:
``q_proj`` → attn_q, ``k_proj`` → attn_k, ``v_proj`` → attn_v, ``o_proj`` → attn_dense,
``gate_proj`` → mlp_h_to_4h, ``down_proj`` → mlp_4h_to_h, ``up_proj`` → mlp_gate; the fused
attn_qkv (rows of B ``[q; k; v]``) and mlp_gate_up (``[gate; up]``) stand for their
component modules.

The mixture-of-experts ids, as TensorRT-LLM's ``lora_manager.py``
(``get_default_trtllm_modules_to_hf_modules``) and its Qwen2-MoE model map them:
moe_h_to_4h (13) → the experts' gate (Mixtral's ``w1``, Qwen's ``experts.gate_proj``),
moe_4h_to_h (14) → down (``w2``), moe_gate (15) → up (``w3``), moe_router (16) → the router
(``gate``), mlp_router (17) → Qwen2-MoE's ``shared_expert_gate``; on a layer with a shared
expert and no dense MLP, mlp_h_to_4h / mlp_4h_to_h / mlp_gate / mlp_gate_up are the shared
expert's ``gate_proj`` / ``down_proj`` / ``up_proj``. An expert row holds every expert:
``A [E, D, Hi]`` then ``B [E, Ho, D]``, each flattened (``LoraManager.load_from_hf`` stacks
the experts' ``lora_A`` / ``lora_B`` so), ``Hi`` / ``Ho`` one expert's widths."""

from __future__ import annotations

import enum

from manylora.config import LORA_EXPERT_MODULES, LORA_TARGET_MODULES
from manylora.lora.formats.peft_config import component_modules
from manylora.lora.formats.target import AdapterTarget


class LoraModuleType(enum.IntEnum):
    """TensorRT-LLM's LoRA module ids (its ``LoraModuleType``); ``trtllm_name`` gives the
    name its ``--lora_target_modules`` uses, e.g. ``attn_q``."""

    ATTN_QKV = 0
    ATTN_Q = 1
    ATTN_K = 2
    ATTN_V = 3
    ATTN_DENSE = 4
    MLP_H_TO_4H = 5
    MLP_4H_TO_H = 6
    MLP_GATE = 7
    CROSS_ATTN_QKV = 8
    CROSS_ATTN_Q = 9
    CROSS_ATTN_K = 10
    CROSS_ATTN_V = 11
    CROSS_ATTN_DENSE = 12
    MOE_H_TO_4H = 13
    MOE_4H_TO_H = 14
    MOE_GATE = 15
    MOE_ROUTER = 16
    MLP_ROUTER = 17
    MLP_GATE_UP = 18

    @property
    def trtllm_name(self) -> str:
        """TensorRT-LLM's string name of the module, e.g. ``"attn_qkv"``."""
        return self.name.lower()

    @classmethod
    def from_trtllm_name(cls, name: str) -> LoraModuleType:
        """The module type of a TensorRT-LLM name such as ``"mlp_gate_up"``.

        Raises:
            ValueError: not one of TensorRT-LLM's module names.
        """
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"{name!r} is not a TensorRT-LLM LoRA module name "
                             f"({', '.join(m.trtllm_name for m in cls)})") from None


#: HF projection → TensorRT-LLM module (LLaMA family, as ``hf_lora_convert.py`` maps them).
HF_TO_TRTLLM: dict[str, LoraModuleType] = {
    "q_proj": LoraModuleType.ATTN_Q,
    "k_proj": LoraModuleType.ATTN_K,
    "v_proj": LoraModuleType.ATTN_V,
    "o_proj": LoraModuleType.ATTN_DENSE,
    "gate_proj": LoraModuleType.MLP_H_TO_4H,
    "down_proj": LoraModuleType.MLP_4H_TO_H,
    "up_proj": LoraModuleType.MLP_GATE,
    "qkv_proj": LoraModuleType.ATTN_QKV,
    "gate_up_proj": LoraModuleType.MLP_GATE_UP,
}


#: TensorRT-LLM module → the HF projections its rows of B stack, in order. Ids missing here
#: (cross attention; the MoE ids, ``TRTLLM_MOE_TO_HF``, unless the target has them) have no
#: layer in the models manylora serves.
TRTLLM_TO_HF: dict[LoraModuleType, tuple[str, ...]] = {
    mtype: component_modules(module) for module, mtype in HF_TO_TRTLLM.items()
}


#: The mixture-of-experts modules (``LORA_MOE_MODULES``) → TensorRT-LLM module; the shared
#: expert's projections take the dense MLP's ids, as TensorRT-LLM's Qwen2-MoE maps them.
HF_MOE_TO_TRTLLM: dict[str, LoraModuleType] = {
    "experts.gate_proj": LoraModuleType.MOE_H_TO_4H,
    "experts.down_proj": LoraModuleType.MOE_4H_TO_H,
    "experts.up_proj": LoraModuleType.MOE_GATE,
    "router": LoraModuleType.MOE_ROUTER,
    "shared_expert_gate": LoraModuleType.MLP_ROUTER,
    "shared_expert.gate_proj": LoraModuleType.MLP_H_TO_4H,
    "shared_expert.down_proj": LoraModuleType.MLP_4H_TO_H,
    "shared_expert.up_proj": LoraModuleType.MLP_GATE,
}


#: TensorRT-LLM's MoE ids → manylora's module (read only for a target whose
#: ``module_shapes`` holds it).
TRTLLM_MOE_TO_HF: dict[LoraModuleType, tuple[str, ...]] = {
    mtype: (module,) for module, mtype in HF_MOE_TO_TRTLLM.items()
    if mtype >= LoraModuleType.MOE_H_TO_4H
}


def trtllm_parts(mtype: LoraModuleType, layer: int,
                 target: AdapterTarget | None) -> tuple[str, ...] | None:
    """The modules a row of ``mtype`` on ``layer`` adapts: ``TRTLLM_TO_HF``'s, or on a
    layer without the dense MLP but with a shared expert its ``shared_expert.*``; a MoE id's
    module when ``target.module_shapes`` holds it; None: no module of this model."""
    if mtype in TRTLLM_TO_HF:
        parts = TRTLLM_TO_HF[mtype]
        shared = tuple(f"shared_expert.{p}" for p in parts)
        if target is not None and not all(target.layer_has(layer, p) for p in parts) and all(
                p in target.module_shapes and target.layer_has(layer, p) for p in shared):
            return shared
        return parts
    parts = TRTLLM_MOE_TO_HF.get(mtype)
    if parts is None or target is None or not all(p in target.module_shapes for p in parts):
        return None
    return parts


def row_values(parts: tuple[str, ...], rank: int, target: AdapterTarget) -> int:
    """``D x Hi + Ho x D`` of a row adapting ``parts`` (``x E`` for the experts)."""
    hi = target.module_shapes[parts[0]][0]
    ho = sum(target.module_shapes[p][1] for p in parts)
    experts = target.num_experts if parts[0] in LORA_EXPERT_MODULES else 1
    return experts * (rank * hi + ho * rank)


def max_rows(target: AdapterTarget) -> int:
    """The most (module, layer) rows an adapter of the base model can hold."""
    moe = sum(1 for m in HF_MOE_TO_TRTLLM if m in target.module_shapes)
    return target.num_layers * (len(LORA_TARGET_MODULES) + moe)
