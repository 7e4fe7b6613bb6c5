"""LoRA shrink: project every token row down to its adapter's rank (Punica's SGMV/BGMV shrink).

Semantics, for every slice ``s`` of a packed projection and token row ``t`` with
``slot[t] >= 0``::

    buffer[t, s, :] = x[t] @ A_s[slot[t]]^T          (accumulated in float32)

Rows whose slot is -1 (base model) are zero. ``lora_shrink`` runs the Triton kernels of
``manylora.ops.triton_lora`` (Punica's SGMV/BGMV, Chen et al. 2023, as in vLLM) on CUDA
tensors and the PyTorch reference ``lora_shrink_reference`` (one gather + matmul per slot
present in the step) elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from manylora.lora.punica import LoRAMapping


def lora_shrink(x: torch.Tensor, lora_a_stacked: Sequence[torch.Tensor],
                mapping: LoRAMapping) -> torch.Tensor:
    """Shrink ``x`` through each row's adapter, all slices and adapters in one call.

    CUDA tensors go to the Triton kernels (``triton_lora.lora_shrink_triton``, one launch,
    schedule ``mapping.schedule``), others to ``lora_shrink_reference``.

    Args:
        x: ``[T, in]`` activations (float32, bfloat16 or float16).
        lora_a_stacked: ``S`` tensors ``[max_loras, max_lora_rank, in]``, one per slice,
            same dtype as ``x``; rows of A past a slot's rank are zero padding. The Triton
            path takes 1 to 3 slices.
        mapping: the step's token → slot map.

    Returns:
        float32 ``[T, S, max_lora_rank]``; zero for base rows and for padded ranks.

    Raises:
        ValueError: on the Triton path, shapes, dtypes or slice counts it does not take.
    """
    if x.is_cuda:
        from manylora.ops.triton_lora import lora_shrink_triton

        return lora_shrink_triton(x, lora_a_stacked, mapping)
    return lora_shrink_reference(x, lora_a_stacked, mapping)


def lora_shrink_reference(x: torch.Tensor, lora_a_stacked: Sequence[torch.Tensor],
                          mapping: LoRAMapping) -> torch.Tensor:
    """PyTorch reference of ``lora_shrink``: a gather and a matmul per slot and slice.

    Reads the mapping's host ``segments`` (empty in a padded, CUDA-graph mapping, which only
    the Triton path takes).

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
