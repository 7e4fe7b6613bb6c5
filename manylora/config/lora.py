"""Adapter slots and the host cache (``LoRAConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The decoder layers' projections, in the order the model applies them: the modules that
#: get slot buffers by default (``lora_target_modules`` unset).
LORA_TARGET_MODULES: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)

#: The model's vocabulary-wide modules an adapter may target (peft's ``embed_tokens`` /
#: ``lm_head`` LoRA): slot buffers only when ``lora_target_modules`` names them, since each
#: slot holds a ``[max_lora_rank, vocab]`` table for each.
LORA_VOCAB_MODULES: tuple[str, ...] = ("embed_tokens", "lm_head")

#: The mixture-of-experts block's modules (Mixtral, Qwen2-MoE, Qwen3-MoE): each expert's
#: gate, up and down projections (one A and B per expert, 3-D: ``a [E, r, in]``,
#: ``b [E, out, r]``; Mixtral's ``w1`` / ``w3`` / ``w2``), the router (HF ``mlp.gate`` /
#: ``block_sparse_moe.gate``, ``[E, H]``), and Qwen2-MoE's shared expert and its gate
#: (``mlp.shared_expert.*``, ``mlp.shared_expert_gate`` ``[1, H]``). Slot buffers only when
#: ``lora_target_modules`` names them (the experts' three together; they take ``E`` times
#: a dense MLP's); the
#: adapter readers produce them only for an ``AdapterTarget`` whose ``module_shapes`` holds
#: them (a MoE model's).
LORA_MOE_MODULES: tuple[str, ...] = (
    "experts.gate_proj", "experts.up_proj", "experts.down_proj", "router",
    "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
    "shared_expert_gate",
)

#: The experts' modules among ``LORA_MOE_MODULES`` (their weights carry an expert axis).
LORA_EXPERT_MODULES: tuple[str, ...] = LORA_MOE_MODULES[:3]

#: Every module an adapter may target (and ``lora_target_modules`` may name).
LORA_ALL_MODULES: tuple[str, ...] = LORA_TARGET_MODULES + LORA_VOCAB_MODULES + LORA_MOE_MODULES

#: The layer index of ``embed_tokens`` and ``lm_head`` in an adapter's ``(layer, module)``
#: keys and the slot table (they belong to no decoder layer).
MODEL_LAYER = -1


@dataclass(frozen=True)
class LoRAConfig:
    """Adapter slots and the host cache (vLLM's LoRAConfig, TensorRT-LLM's lora_target_modules
    and PEFT cache bounds).

    Attributes:
        max_loras: device slots, i.e. distinct adapters per step.
        max_lora_rank: rank every slot buffer is padded to.
        max_cpu_loras: adapters kept loaded in host memory (LRU), ≥ max_loras.
        target_modules: modules that get slot buffers (default: the seven projections;
            ``embed_tokens``, ``lm_head`` and the MoE block's ``LORA_MOE_MODULES`` only when
            named, as TensorRT-LLM's ``lora_target_modules``); an adapter that targets
            another one is refused.
        max_cpu_lora_bytes: bytes of adapter tensors the host cache may hold (None: bounded
            by count only).
        fully_sharded_loras: under tensor parallelism, also shard the half of each adapter
            that is otherwise replicated (vLLM's ``fully_sharded_loras``, after S-LoRA):
            A along the rank for column-parallel projections (``max_lora_rank`` must be
            divisible by the number of ranks), B along its output for row-parallel ones, at
            the cost of one more collective per column-parallel projection (an all-gather)
            and two more per row-parallel one (an all-reduce, an all-gather). No effect on
            one rank, nor on the ``embed_tokens`` / ``lm_head`` slots (``lora.vocab``).
        load_timeout: seconds one adapter read (disk to host memory: parse, validate,
            digest, pin; from the moment a loader thread starts it) may go without progress
            (a module read); one stuck longer fails alone (``LoRALoadTimeoutError``). None:
            no bound.
        dtype: of the slot buffers and the adapters in the host cache (adapters are cast to
            it when read; ``resolve_lora_dtype``); None: the model's.
    """

    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int = 32
    target_modules: tuple[str, ...] = LORA_TARGET_MODULES
    max_cpu_lora_bytes: int | None = None
    fully_sharded_loras: bool = False
    load_timeout: float | None = 60.0
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.load_timeout is not None and not self.load_timeout > 0:
            raise ValueError(f"lora load_timeout must be > 0 seconds, got {self.load_timeout}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be ≥ 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be ≥ 1, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be ≥ max_loras ({self.max_loras})")
        if self.max_cpu_lora_bytes is not None and self.max_cpu_lora_bytes < 1:
            raise ValueError(f"max_cpu_lora_bytes must be ≥ 1, got {self.max_cpu_lora_bytes}")
        unknown = [m for m in self.target_modules if m not in LORA_ALL_MODULES]
        if unknown or not self.target_modules:
            raise ValueError(
                f"lora_target_modules {unknown or '[]'} invalid: choose from "
                f"{', '.join(LORA_ALL_MODULES)}")
        experts = [m for m in LORA_EXPERT_MODULES if m in self.target_modules]
        if experts and len(experts) != len(LORA_EXPERT_MODULES):
            raise ValueError(
                f"lora_target_modules names {', '.join(experts)}: the experts' modules get "
                f"slot buffers together, name all of {', '.join(LORA_EXPERT_MODULES)}")
