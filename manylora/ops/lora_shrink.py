"""LoRA shrink: project every token row down to its adapter's rank (Punica's SGMV/BGMV shrink).

Semantics, for every slice ``s`` of a packed projection and token row ``t`` with
``slot[t] >= 0``::

    buffer[t, s, :] = x[t] @ A_s[slot[t]]^T          (accumulated in float32)

Rows whose slot is -1 (base model) are zero. This module holds the PyTorch reference
(one gather + matmul per slot present in the step); a Triton kernel with the same
signature replaces it on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from manylora.lora.punica import LoRAMapping


def lora_shrink(x: torch.Tensor, lora_a_stacked: Sequence[torch.Tensor],
                mapping: LoRAMapping) -> torch.Tensor:
    """Shrink ``x`` through each row's adapter, all slices and adapters in one call.

    Args:
        x: ``[T, in]`` activations (float32, bfloat16 or float16).
        lora_a_stacked: ``S`` tensors ``[max_loras, max_lora_rank, in]``, one per slice,
            same dtype as ``x``; rows of A past a slot's rank are zero padding.
        mapping: the step's token → slot map.

    Returns:
        float32 ``[T, S, max_lora_rank]``; zero for base rows and for padded ranks.
    """
    num_slices = len(lora_a_stacked)
    max_rank = lora_a_stacked[0].shape[1]
    buffer = torch.zeros(x.shape[0], num_slices, max_rank, dtype=torch.float32, device=x.device)
    for seg in mapping.segments:
        xs = x.index_select(0, seg.rows).float()                       # [n, in]
        for s, a_stacked in enumerate(lora_a_stacked):
            a = a_stacked[seg.slot, : seg.rank].float()                # [r, in]
            buffer[seg.rows, s, : seg.rank] = xs @ a.t()
    return buffer
