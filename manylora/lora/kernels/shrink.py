"""LoRA shrink: project every token row down to its adapter's rank (Punica's SGMV/BGMV shrink).

Semantics, for every slice ``s`` of a packed projection and token row ``t`` with
``slot[t] >= 0``, ``r = ranks[slot[t], s]`` the (slot, module)'s rank in the model's
``SlotTable`` and ``c = clamp(r - rank_start, 0, R)`` the rows of A this tensor-parallel rank
holds (``rank_start`` 0 and ``R`` = A's rows unless A is cut along the rank)::

    buffer[t, s, :c] = x[t] @ A_s[slot[t], :c]^T          (accumulated in float32)
    buffer[t, s, c:] = 0

Rows whose slot is -1 (base model) are zero, as is every row of a (slot, slice) of rank 0.
``lora_shrink`` runs the Triton ops of ``manylora.lora.kernels.triton_lora`` (Punica's SGMV/BGMV,
Chen et al. 2023, as in vLLM) on CUDA tensors and the PyTorch reference
``lora_shrink_reference`` (one gather + matmul per slot present in the step) elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from manylora.lora.kernels.meta import LoRAKernelMeta


def lora_shrink(x: torch.Tensor, lora_a_stacked: Sequence[torch.Tensor], ranks: torch.Tensor,
                lora_meta: LoRAKernelMeta, *, rank_start: int = 0) -> torch.Tensor:
    """Shrink ``x`` through each row's adapter, all slices and adapters in one call.

    CUDA tensors go to the Triton kernels (``triton_lora.lora_shrink_triton``, one launch,
    variant ``lora_meta.variant``), others to ``lora_shrink_reference``.

    Args:
        x: ``[T, in]`` activations (float32, bfloat16 or float16).
        lora_a_stacked: ``S`` tensors ``[max_loras, R, in]``, one per slice, same dtype as
            ``x``; rows past a (slot, slice)'s rank are never read. The Triton path takes
            1 to 3 slices.
        ranks: int32 ``[max_loras, S]``, each (slot, slice)'s rank (``LoRASlots.ranks``, the
            projection's columns of the ``SlotTable``).
        lora_meta: the step's token → slot map.
        rank_start: the first rank row A holds (fully sharded column parallelism).

    Returns:
        float32 ``[T, S, R]``; zero for base rows and past each (slot, slice)'s rank.

    Raises:
        ValueError: on the Triton path, shapes, dtypes or slice counts it does not take.
    """
    if x.is_cuda:
        from manylora.lora.kernels.triton_lora import lora_shrink_triton

        return lora_shrink_triton(x, lora_a_stacked, ranks, lora_meta, rank_start=rank_start)
    return lora_shrink_reference(x, lora_a_stacked, ranks, lora_meta, rank_start=rank_start)


def lora_shrink_reference(x: torch.Tensor, lora_a_stacked: Sequence[torch.Tensor],
                          ranks: torch.Tensor, lora_meta: LoRAKernelMeta, *,
                          rank_start: int = 0) -> torch.Tensor:
    """PyTorch reference of ``lora_shrink``: a gather and a matmul per slot and slice.

    Reads the mapping's host ``segments`` (empty in a padded, CUDA-graph one, which only
    the Triton path takes) and ``ranks`` (copied to the host once).

    Args:
        x: ``[T, in]`` activations (float32, bfloat16 or float16).
        lora_a_stacked: ``S`` tensors ``[max_loras, R, in]``, same dtype as ``x``.
        ranks: int32 ``[max_loras, S]``, each (slot, slice)'s rank.
        lora_meta: the step's token → slot map.
        rank_start: the first rank row A holds.

    Returns:
        float32 ``[T, S, R]``; zero for base rows and past each (slot, slice)'s rank.
    """
    num_slices = len(lora_a_stacked)
    max_rank = lora_a_stacked[0].shape[1]
    buffer = torch.zeros(x.shape[0], num_slices, max_rank, dtype=torch.float32, device=x.device)
    table = ranks.tolist() if lora_meta.segments else []
    for seg in lora_meta.segments:
        xs = None
        for s, a_stacked in enumerate(lora_a_stacked):
            r = min(max(table[seg.slot][s] - rank_start, 0), max_rank)
            if not r:
                continue
            if xs is None:
                xs = x.index_select(0, seg.rows).float()               # [n, in]
            a = a_stacked[seg.slot, :r].float()                        # [r, in]
            buffer[seg.rows, s, :r] = xs @ a.t()
    return buffer
