"""TensorRT-LLM's LoRA module ids (its ``LoraModuleType``) and how they map to the HF
projections of the LLaMA family, as its ``examples/hf_lora_convert.py`` maps them:
``q_proj`` → attn_q, ``k_proj`` → attn_k, ``v_proj`` → attn_v, ``o_proj`` → attn_dense,
``gate_proj`` → mlp_h_to_4h, ``down_proj`` → mlp_4h_to_h, ``up_proj`` → mlp_gate; the fused
attn_qkv (rows of B ``[q; k; v]``) and mlp_gate_up (``[gate; up]``) stand for their
component modules."""

from __future__ import annotations

import enum

from manylora.lora.formats.peft_config import component_modules


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
#: (cross attention, MoE, routers) have no layer in the models manylora serves.
TRTLLM_TO_HF: dict[LoraModuleType, tuple[str, ...]] = {
    mtype: component_modules(module) for module, mtype in HF_TO_TRTLLM.items()
}
