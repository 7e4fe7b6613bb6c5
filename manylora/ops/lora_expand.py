"""LoRA expand: add each row's low-rank delta into the base output (Punica's SGMV/BGMV expand).

Semantics, for every slice ``s`` (output columns ``off_s .. off_s + out_s``) and token row
``t`` with ``slot[t] >= 0``::

    y[t, off_s : off_s + out_s] += buffer[t, s] @ B_s[slot[t]]^T

in place; rows whose slot is -1 are left untouched. The LoRA scaling (alpha/r or
alpha/sqrt(r)) is already folded into B. ``lora_expand`` runs the Triton kernels of
``manylora.ops.triton_lora`` (Punica's SGMV/BGMV, Chen et al. 2023, as in vLLM) on CUDA
tensors and the PyTorch reference ``lora_expand_reference`` elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from manylora.lora.punica import LoRAMapping


def lora_expand(y: torch.Tensor, buffer: torch.Tensor, lora_b_stacked: Sequence[torch.Tensor],
                mapping: LoRAMapping, output_slices: Sequence[tuple[int, int]]) -> None:
    """Add ``buffer @ B^T`` of each row's adapter into ``y``, all slices in one call.

    CUDA tensors go to the Triton kernels (``triton_lora.lora_expand_triton``, one launch,
    schedule ``mapping.schedule``), others to ``lora_expand_reference``.

    Args:
        y: ``[T, out_total]`` base-layer output, updated in place.
        buffer: float32 ``[T, S, max_lora_rank]`` from ``lora_shrink``.
        lora_b_stacked: ``S`` tensors ``[max_loras, out_s, max_lora_rank]``, dtype of ``y``;
            columns past a slot's rank are zero padding. The Triton path takes 1 to 3 slices.
        mapping: the step's token → slot map.
        output_slices: ``S`` pairs ``(offset, out_s)``: the columns of ``y`` slice ``s`` adds
            to; they must not overlap.

    Raises:
        ValueError: ``output_slices`` and ``lora_b_stacked`` disagree in length; on the
            Triton path, also shapes, dtypes or slice counts it does not take.
    """
    if y.is_cuda:
        from manylora.ops.triton_lora import lora_expand_triton

        lora_expand_triton(y, buffer, lora_b_stacked, mapping, output_slices)
        return
    lora_expand_reference(y, buffer, lora_b_stacked, mapping, output_slices)


def lora_expand_reference(y: torch.Tensor, buffer: torch.Tensor,
                          lora_b_stacked: Sequence[torch.Tensor], mapping: LoRAMapping,
                          output_slices: Sequence[tuple[int, int]]) -> None:
    """PyTorch reference of ``lora_expand``: a gather and a matmul per slot and slice.

    Reads the mapping's host ``segments`` (empty in a padded, CUDA-graph mapping, which only
    the Triton path takes).

    Args:
        y: ``[T, out_total]`` base-layer output, updated in place.
        buffer: float32 ``[T, S, max_lora_rank]`` from ``lora_shrink``.
        lora_b_stacked: ``S`` tensors ``[max_loras, out_s, max_lora_rank]``, dtype of ``y``.
        mapping: the step's token → slot map.
        output_slices: ``S`` pairs ``(offset, out_s)``: the columns of ``y`` slice ``s`` adds to.

    Raises:
        ValueError: ``output_slices`` and ``lora_b_stacked`` disagree in length.
    """
    if len(output_slices) != len(lora_b_stacked):
        raise ValueError(
            f"{len(output_slices)} output slices for {len(lora_b_stacked)} B stacks")
    for seg in mapping.segments:
        for s, (b_stacked, (offset, size)) in enumerate(zip(lora_b_stacked, output_slices)):
            b = b_stacked[seg.slot, :, : seg.rank].float()              # [out_s, r]
            delta = buffer[seg.rows, s, : seg.rank] @ b.t()             # [n, out_s]
            y[seg.rows, offset: offset + size] += delta.to(y.dtype)
