"""Frozen configuration records, one per component, each checked when it is built.

Every component receives the narrowest of these it needs: the scheduler gets a
``SchedulerConfig``, the KV cache manager a ``CacheConfig``, the adapter manager a
``LoRAConfig``, the model a ``ModelConfig`` (with its ``QuantizationConfig``). One module
per record (``model``, ``cache``, ``scheduler``, ``lora``, ``quantization``), the
dtype/device names in ``dtypes`` and the model registry's table in ``architectures``; every
name is importable from ``manylora.config``.
"""

from manylora.config.architectures import (
    MODEL_ARCHITECTURES,
    resolve_architecture,
)
from manylora.config.cache import KV_CACHE_DTYPES, CacheConfig
from manylora.config.dtypes import (
    LORA_DTYPE_NAMES,
    resolve_device,
    resolve_dtype,
    resolve_lora_dtype,
)
from manylora.config.lora import (
    LORA_ALL_MODULES,
    LORA_EXPERT_MODULES,
    LORA_MOE_MODULES,
    LORA_TARGET_MODULES,
    LORA_VOCAB_MODULES,
    MODEL_LAYER,
    LoRAConfig,
)
from manylora.config.model import ModelConfig
from manylora.config.moe import MoEShape, moe_shape
from manylora.config.quantization import (
    QUANTIZATION_METHODS,
    QuantizationConfig,
    QuantizationError,
    parse_quantization,
)
from manylora.config.scheduler import SCHEDULING_POLICIES, SchedulerConfig, check_fairness

__all__ = [
    "KV_CACHE_DTYPES", "LORA_ALL_MODULES", "LORA_DTYPE_NAMES", "LORA_EXPERT_MODULES",
    "LORA_MOE_MODULES", "LORA_TARGET_MODULES", "LORA_VOCAB_MODULES", "MODEL_ARCHITECTURES",
    "MODEL_LAYER", "MoEShape", "moe_shape",
    "SCHEDULING_POLICIES", "CacheConfig", "LoRAConfig",
    "ModelConfig", "QUANTIZATION_METHODS", "QuantizationConfig", "QuantizationError",
    "SchedulerConfig", "check_fairness", "parse_quantization", "resolve_architecture",
    "resolve_device", "resolve_dtype", "resolve_lora_dtype",
]
