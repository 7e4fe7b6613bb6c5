"""How much device memory one adapter slot takes, and how many slots a memory share buys
(TensorRT-LLM's ``device_cache_percent``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from manylora.config import LORA_EXPERT_MODULES


def slot_bytes(module_shapes: Mapping[str, tuple[int, int]],
               module_copies: Mapping[str, tuple[int, int]], target_modules: Sequence[str],
               max_lora_rank: int, dtype: torch.dtype) -> int:
    """Bytes of one slot over the whole model: A ``[max_lora_rank, in]`` and B
    ``[max_lora_rank, out]`` in ``dtype`` per A/B pair of each targeted module (a decoder
    layer's projection, each expert of a MoE layer's expert module, ``embed_tokens`` /
    ``lm_head``), and per rank-table column the two int32 entries (rank, DoRA flag) and,
    outside the experts (no DoRA), the float32 DoRA scale ``[out]``
    (``module_copies``: ``ModelConfig.module_copies``'s ``{module: (columns, pairs)}``)."""
    elem = torch.empty((), dtype=dtype).element_size()
    total = 0
    for module in target_modules:
        in_f, out_f = module_shapes[module]
        columns, pairs = module_copies.get(module, (0, 0))
        scale = 0 if module in LORA_EXPERT_MODULES else out_f * 4
        total += (in_f + out_f) * max_lora_rank * elem * pairs + (scale + 2 * 4) * columns
    return total


def slots_for_memory(free_bytes: int, percent: float, bytes_per_slot: int,
                     reserved_bytes: int = 0) -> int:
    """Slots that fit in ``percent`` (a share in (0, 1]) of ``free_bytes``, after
    ``reserved_bytes`` of it (the slot loads' staging buffer, about one slot).

    Raises:
        ValueError: ``percent`` outside (0, 1], or not even one slot fits.
    """
    if not 0.0 < percent <= 1.0:
        raise ValueError(f"lora_device_cache_percent must be in (0, 1], got {percent}")
    slots = int((free_bytes * percent - reserved_bytes) // bytes_per_slot)
    if slots < 1:
        raise ValueError(
            f"lora_device_cache_percent={percent} of the {free_bytes / 2**20:.0f} MiB left "
            f"free holds no adapter slot ({bytes_per_slot / 2**20:.1f} MiB each): raise it, "
            "lower max_lora_rank or gpu_memory_utilization, or set max_loras")
    return slots
