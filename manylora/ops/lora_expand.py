"""LoRA expand: add each row's low-rank delta into the base output (Punica's SGMV/BGMV expand).

Semantics, for every slice ``s`` (output columns ``cols = off_s .. off_s + out_s``) and token
row ``t`` with ``slot[t] >= 0``::

    delta       = buffer[t, s] @ B_s[slot[t]]^T
    y[t, cols] += delta                                              (plain LoRA)
    y[t, cols]  = (y[t, cols] + delta) * scale_s[slot] + shift_s[slot]   (DoRA slot)

in place; rows whose slot is -1 are left untouched. The LoRA scaling (alpha/r or
alpha/sqrt(r)) is already folded into B. DoRA (Liu et al. 2024, arXiv 2402.09353) applies to
the slots flagged in ``LoRAMapping.slot_dora`` when scales are given: with ``y = x W^T + bias``,
``scale = m / ||W + BA||`` and ``shift = (1 - scale) * bias`` (0 without a bias) the row gets
peft's ``scale * (x W^T + delta) + bias``. ``lora_expand`` runs the Triton kernels of
``manylora.ops.triton_lora`` (Punica's SGMV/BGMV, Chen et al. 2023, as in vLLM) on CUDA
tensors and the PyTorch reference ``lora_expand_reference`` elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from manylora.lora.punica import LoRAMapping


def lora_expand(y: torch.Tensor, buffer: torch.Tensor, lora_b_stacked: Sequence[torch.Tensor],
                mapping: LoRAMapping, output_slices: Sequence[tuple[int, int]],
                dora_scale_stacked: Sequence[torch.Tensor] | None = None,
                dora_shift_stacked: Sequence[torch.Tensor] | None = None) -> None:
    """Add ``buffer @ B^T`` of each row's adapter into ``y``, all slices in one call; rows of
    DoRA slots are rescaled as well (see the module docstring).

    CUDA tensors go to the Triton kernels (``triton_lora.lora_expand_triton``, one launch,
    schedule ``mapping.schedule``), others to ``lora_expand_reference``.

    Args:
        y: ``[T, out_total]`` base-layer output (bias included), updated in place.
        buffer: float32 ``[T, S, max_lora_rank]`` from ``lora_shrink``.
        lora_b_stacked: ``S`` tensors ``[max_loras, out_s, max_lora_rank]``, dtype of ``y``;
            columns past a slot's rank are zero padding. The Triton path takes 1 to 3 slices.
        mapping: the step's token → slot map; ``mapping.slot_dora`` says which slots are DoRA.
        output_slices: ``S`` pairs ``(offset, out_s)``: the columns of ``y`` slice ``s`` adds
            to; they must not overlap.
        dora_scale_stacked: None (no DoRA), or ``S`` float32 ``[max_loras, out_s]`` tensors,
            each slot's DoRA scale ``m / ||W + BA||`` (read only for DoRA slots).
        dora_shift_stacked: None, or ``S`` float32 ``[max_loras, out_s]`` tensors added after
            the scaling, ``(1 - scale) * bias``; only with ``dora_scale_stacked``.

    Raises:
        ValueError: ``output_slices`` and ``lora_b_stacked`` disagree in length, DoRA stacks
            of another count or shape, or shifts without scales; on the Triton path, also
            shapes, dtypes or slice counts it does not take.
    """
    if y.is_cuda:
        from manylora.ops.triton_lora import lora_expand_triton

        lora_expand_triton(y, buffer, lora_b_stacked, mapping, output_slices,
                           dora_scale_stacked, dora_shift_stacked)
        return
    lora_expand_reference(y, buffer, lora_b_stacked, mapping, output_slices,
                          dora_scale_stacked, dora_shift_stacked)


def lora_expand_reference(y: torch.Tensor, buffer: torch.Tensor,
                          lora_b_stacked: Sequence[torch.Tensor], mapping: LoRAMapping,
                          output_slices: Sequence[tuple[int, int]],
                          dora_scale_stacked: Sequence[torch.Tensor] | None = None,
                          dora_shift_stacked: Sequence[torch.Tensor] | None = None) -> None:
    """PyTorch reference of ``lora_expand``: a gather and a matmul per slot and slice.

    Reads the mapping's host ``segments`` (empty in a padded, CUDA-graph mapping, which only
    the Triton path takes), whose ``dora`` field says which slots are DoRA. Plain LoRA rows
    get ``y += delta`` (delta rounded to ``y``'s dtype); DoRA rows
    ``(y + delta) * scale (+ shift)`` computed in float32 and rounded once.

    Args:
        y: ``[T, out_total]`` base-layer output, updated in place.
        buffer: float32 ``[T, S, max_lora_rank]`` from ``lora_shrink``.
        lora_b_stacked: ``S`` tensors ``[max_loras, out_s, max_lora_rank]``, dtype of ``y``.
        mapping: the step's token → slot map.
        output_slices: ``S`` pairs ``(offset, out_s)``: the columns of ``y`` slice ``s`` adds to.
        dora_scale_stacked: None, or ``S`` float32 ``[max_loras, out_s]`` DoRA scales.
        dora_shift_stacked: None, or ``S`` float32 ``[max_loras, out_s]`` DoRA shifts.

    Raises:
        ValueError: ``output_slices`` and ``lora_b_stacked`` disagree in length, DoRA stacks
            of another count or shape, or shifts without scales.
    """
    if len(output_slices) != len(lora_b_stacked):
        raise ValueError(
            f"{len(output_slices)} output slices for {len(lora_b_stacked)} B stacks")
    _check_dora_stacks(lora_b_stacked, dora_scale_stacked, dora_shift_stacked)
    for seg in mapping.segments:
        dora = seg.dora and dora_scale_stacked is not None
        for s, (b_stacked, (offset, size)) in enumerate(zip(lora_b_stacked, output_slices)):
            b = b_stacked[seg.slot, :, : seg.rank].float()              # [out_s, r]
            delta = buffer[seg.rows, s, : seg.rank] @ b.t()             # [n, out_s]
            cols = slice(offset, offset + size)
            if not dora:
                y[seg.rows, cols] += delta.to(y.dtype)
                continue
            out = (y[seg.rows, cols].float() + delta) * dora_scale_stacked[s][seg.slot]
            if dora_shift_stacked is not None:
                out += dora_shift_stacked[s][seg.slot]
            y[seg.rows, cols] = out.to(y.dtype)


def _check_dora_stacks(lora_b_stacked: Sequence[torch.Tensor],
                       scales: Sequence[torch.Tensor] | None,
                       shifts: Sequence[torch.Tensor] | None) -> None:
    """Raise ValueError unless the DoRA stacks are absent or one float32
    ``[max_loras, out_s]`` per B stack (shifts only with scales)."""
    if scales is None:
        if shifts is not None:
            raise ValueError("lora_expand: DoRA shifts were given without DoRA scales")
        return
    want = [(b.shape[0], b.shape[1]) for b in lora_b_stacked]
    for name, stacks in (("scales", scales), ("shifts", shifts)):
        if stacks is not None and ([tuple(t.shape) for t in stacks] != want
                                   or any(t.dtype != torch.float32 for t in stacks)):
            raise ValueError(f"lora_expand: DoRA {name} {[tuple(t.shape) for t in stacks]}, "
                             f"expected float32 {want}")
