"""Argument checks shared by the LoRA ops (``triton_lora.py``, ``triton_lora_tiled.py``):
the slot stacks, the rank / DoRA table views, the activation dtypes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from manylora.lora.kernels.plans import MAX_SLICES

#: Activation and slot dtypes the LoRA kernels take.
LORA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_table(name: str, what: str, t: torch.Tensor, max_loras: int, num_slices: int,
                device: torch.device) -> None:
    """Raise ValueError unless ``t`` is an int32 ``[max_loras, S]`` table view on ``device``
    whose slices are adjacent (unit column stride)."""
    if (t.dtype != torch.int32 or tuple(t.shape) != (max_loras, num_slices)
            or t.device != device or (num_slices > 1 and t.stride(1) != 1)):
        raise ValueError(f"{name}: {what} must be an int32 [{max_loras}, {num_slices}] view of "
                         f"the slot table on {device} (unit column stride), got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}, strides {t.stride()}")


def check_stacks(name: str, stacks: Sequence[torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> None:
    """Raise ValueError unless ``stacks`` are 1 to ``MAX_SLICES`` 3-d ``dtype`` tensors on
    ``device`` (one slot stack per slice)."""
    if not 1 <= len(stacks) <= MAX_SLICES:
        raise ValueError(f"{name}: {len(stacks)} slices, the kernels take 1 to {MAX_SLICES}")
    for t in stacks:
        if t.dim() != 3 or t.dtype != dtype or t.device != device:
            raise ValueError(f"{name}: expected 3-d {dtype} tensors on {device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
