"""LoRA expand: add each row's low-rank delta into the base output (Punica's SGMV/BGMV expand).

Semantics, for every slice ``s`` (output columns ``cols = off_s .. off_s + out_s``) and token
row ``t`` with ``slot[t] >= 0``, ``r = ranks[slot[t], s]`` the (slot, module)'s rank in the
model's ``SlotTable`` and ``B_s[slot]`` stored rank-major (``[R, out_s]``, rows ``[0, r)``
read)::

    delta       = buffer[t, s, :r] @ B_s[slot[t], :r]
    y[t, cols] += delta                                                  (plain LoRA)
    y[t, cols]  = (y[t, cols] + delta) * scale_s[slot] + (1 - scale_s[slot]) * bias[cols]
                                                            (DoRA: dora[slot, s] = 1)

in place; rows whose slot is -1, and every row of a (slot, slice) of rank 0, are left
untouched. The LoRA scaling (alpha/r or alpha/sqrt(r)) is already folded into B. DoRA (Liu et
al. 2024, arXiv 2402.09353): with ``y = x W^T + bias`` and ``scale = m / ||W + BA||`` the
row gets peft's ``scale * (x W^T + delta) + bias`` (no bias term without a bias).
``lora_expand`` runs the Triton ops of ``manylora.lora.kernels.triton_lora`` (Punica's SGMV/BGMV,
Chen et al. 2023, as in vLLM) on CUDA tensors and the PyTorch reference
``lora_expand_reference`` elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from manylora.lora.kernels.meta import LoRAKernelMeta


def lora_expand(y: torch.Tensor, buffer: torch.Tensor, lora_b_stacked: Sequence[torch.Tensor],
                ranks: torch.Tensor, lora_meta: LoRAKernelMeta,
                output_slices: Sequence[tuple[int, int]], dora: torch.Tensor | None = None,
                dora_scale_stacked: Sequence[torch.Tensor] | None = None,
                bias: torch.Tensor | None = None) -> None:
    """Add ``buffer @ B`` of each row's adapter into ``y``, all slices in one call; rows of
    DoRA (slot, slice)s are rescaled as well (see the module docstring).

    CUDA tensors go to the Triton kernels (``triton_lora.lora_expand_triton``, one launch,
    variant ``lora_meta.variant``), others to ``lora_expand_reference``.

    Args:
        y: ``[T, out_total]`` base-layer output (bias included), updated in place.
        buffer: float32 ``[T, S, R]`` from ``lora_shrink``.
        lora_b_stacked: ``S`` tensors ``[max_loras, R, out_s]`` (rank-major), dtype of ``y``;
            rows past a (slot, slice)'s rank are never read. The Triton path takes 1 to 3
            slices.
        ranks: int32 ``[max_loras, S]``, each (slot, slice)'s rank (``LoRASlots.ranks``).
        lora_meta: the step's token → slot map.
        output_slices: ``S`` pairs ``(offset, out_s)``: the columns of ``y`` slice ``s`` adds
            to; they must not overlap.
        dora: int32 ``[max_loras, S]``, 1 where the (slot, slice) has DoRA scales
            (``LoRASlots.dora``); needed with ``dora_scale_stacked``.
        dora_scale_stacked: None (no DoRA), or ``S`` float32 ``[max_loras, out_s]`` tensors,
            the DoRA scales ``m / ||W + BA||`` (read only where ``dora`` is 1).
        bias: None, or ``[out_total]`` in ``y``'s dtype, the bias ``y`` includes; DoRA rows
            get ``(1 - scale) * bias`` added (only with ``dora_scale_stacked``).

    Raises:
        ValueError: ``output_slices`` and ``lora_b_stacked`` disagree in length, DoRA
            arguments of another count or shape, or a bias without scales; on the Triton
            path, also shapes, dtypes or slice counts it does not take.
    """
    if y.is_cuda:
        from manylora.lora.kernels.triton_lora import lora_expand_triton

        lora_expand_triton(y, buffer, lora_b_stacked, ranks, lora_meta, output_slices, dora,
                           dora_scale_stacked, bias)
        return
    lora_expand_reference(y, buffer, lora_b_stacked, ranks, lora_meta, output_slices, dora,
                          dora_scale_stacked, bias)


def lora_expand_reference(y: torch.Tensor, buffer: torch.Tensor,
                          lora_b_stacked: Sequence[torch.Tensor], ranks: torch.Tensor,
                          lora_meta: LoRAKernelMeta, output_slices: Sequence[tuple[int, int]],
                          dora: torch.Tensor | None = None,
                          dora_scale_stacked: Sequence[torch.Tensor] | None = None,
                          bias: torch.Tensor | None = None) -> None:
    """PyTorch reference of ``lora_expand``: a gather and a matmul per slot and slice.

    Reads the mapping's host ``segments`` (empty in a padded, CUDA-graph one, which only
    the Triton path takes), ``ranks`` and ``dora`` (copied to the host once). Plain LoRA
    rows get ``y += delta`` (delta rounded to ``y``'s dtype); DoRA rows
    ``(y + delta) * scale + (1 - scale) * bias`` computed in float32 and rounded once.

    Args:
        y: ``[T, out_total]`` base-layer output, updated in place.
        buffer: float32 ``[T, S, R]`` from ``lora_shrink``.
        lora_b_stacked: ``S`` tensors ``[max_loras, R, out_s]``, dtype of ``y``.
        ranks: int32 ``[max_loras, S]``; dora: int32 ``[max_loras, S]`` or None.
        lora_meta: the step's token → slot map.
        output_slices: ``S`` pairs ``(offset, out_s)``: the columns of ``y`` slice ``s`` adds to.
        dora_scale_stacked: None, or ``S`` float32 ``[max_loras, out_s]`` DoRA scales.
        bias: None, or ``[out_total]``, the bias in ``y``.

    Raises:
        ValueError: ``output_slices`` and ``lora_b_stacked`` disagree in length, DoRA
            arguments of another count or shape, or a bias without scales.
    """
    if len(output_slices) != len(lora_b_stacked):
        raise ValueError(
            f"{len(output_slices)} output slices for {len(lora_b_stacked)} B stacks")
    _check_dora_args(lora_b_stacked, dora, dora_scale_stacked, bias, y)
    if not lora_meta.segments:
        return
    table = ranks.tolist()
    flags = dora.tolist() if dora_scale_stacked is not None else None
    for seg in lora_meta.segments:
        for s, (b_stacked, (offset, size)) in enumerate(zip(lora_b_stacked, output_slices)):
            r = table[seg.slot][s]
            if not r:
                continue
            b = b_stacked[seg.slot, :r].float()                         # [r, out_s]
            delta = buffer[seg.rows, s, :r] @ b                         # [n, out_s]
            cols = slice(offset, offset + size)
            if flags is None or not flags[seg.slot][s]:
                y[seg.rows, cols] += delta.to(y.dtype)
                continue
            scale = dora_scale_stacked[s][seg.slot]
            out = (y[seg.rows, cols].float() + delta) * scale
            if bias is not None:
                out += (1.0 - scale) * bias[cols].float()
            y[seg.rows, cols] = out.to(y.dtype)


def _check_dora_args(lora_b_stacked: Sequence[torch.Tensor], dora: torch.Tensor | None,
                     scales: Sequence[torch.Tensor] | None, bias: torch.Tensor | None,
                     y: torch.Tensor) -> None:
    """Raise ValueError unless the DoRA arguments are absent or ``dora`` int32
    ``[max_loras, S]``, one float32 ``[max_loras, out_s]`` scale per B stack and a bias
    (if any) of ``y``'s width."""
    if scales is None:
        if bias is not None:
            raise ValueError("lora_expand: a DoRA bias was given without DoRA scales")
        return
    num_slices = len(lora_b_stacked)
    max_loras = lora_b_stacked[0].shape[0]
    if dora is None or tuple(dora.shape) != (max_loras, num_slices):
        got = None if dora is None else tuple(dora.shape)
        raise ValueError(f"lora_expand: DoRA scales need dora flags [{max_loras}, "
                         f"{num_slices}], got {got}")
    want = [(b.shape[0], b.shape[2]) for b in lora_b_stacked]
    if [tuple(t.shape) for t in scales] != want or any(t.dtype != torch.float32
                                                       for t in scales):
        raise ValueError(f"lora_expand: DoRA scales {[tuple(t.shape) for t in scales]}, "
                         f"expected float32 {want}")
    if bias is not None and tuple(bias.shape) != (y.shape[1],):
        raise ValueError(f"lora_expand: bias {tuple(bias.shape)} for {y.shape[1]} columns")
