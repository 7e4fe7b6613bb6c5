"""The tiled LoRA shrink/expand: each adapter read once per row tile (``lora_tiled_kernels``).

The wrappers check their arguments, size the launch (``lora_tiled_plans``) and launch one
kernel for all slices of a packed projection. They are CUDA-graph safe (no host
synchronisation; grids from tensor shapes and host ints) and run on any device Triton runs
on, including CPU tensors under ``TRITON_INTERPRET=1``. A CUDA-graph (padded) mapping has
``max_row_tiles(rows, max_loras, BLOCK_M)`` tiles, a function of the padded row count only
(``lora/kernels/row_tiles.py``), so one captured graph serves every split of the rows over slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from manylora.lora.kernels import tiled_kernels as lora_tiled_kernels
from manylora.lora.kernels.checks import LORA_DTYPES, check_stacks, check_table
from manylora.lora.kernels.plans import MAX_SLICES, interpreted_bf16
from manylora.lora.kernels.tiled_plans import tiled_expand_plan, tiled_shrink_plan


def _check_rows(num_rows: int, sorted_rows: torch.Tensor) -> None:
    if sorted_rows.shape[0] != num_rows:
        raise ValueError(f"the mapping has {sorted_rows.shape[0]} rows, the activations "
                         f"{num_rows}")


def lora_shrink_tiled(x: torch.Tensor, lora_a_stacked: Sequence[torch.Tensor],
                      ranks: torch.Tensor, sorted_rows: torch.Tensor, tile_slot: torch.Tensor,
                      tile_start: torch.Tensor, tile_len: torch.Tensor, block_m: int,
                      rank_start: int = 0) -> torch.Tensor:
    """``buffer[t, s, :c] = x[t] @ A_s[slot, :c]^T`` with ``c = clamp(ranks[slot, s] -
    rank_start, 0, R)`` over the step's row tiles, all slices in one launch
    (``lora_tiled_kernels``); registered as ``torch.ops.manylora.lora_shrink_tiled``.

    Args:
        x: ``[T, in]``, float32, bfloat16 or float16.
        lora_a_stacked: 1-3 contiguous ``[max_loras, R, in]`` tensors, dtype of ``x``; rows
            past a (slot, slice)'s rank are never read.
        ranks: int32 ``[max_loras, S]`` (unit column stride): the projection's columns of
            the ``SlotTable``.
        sorted_rows, tile_slot, tile_start, tile_len, block_m: the step's ``LoRAKernelMeta``
            fields (int32 ``[T]``, int32 ``[NT]`` each, host int).
        rank_start: the first rank row A holds (fully sharded column parallelism; else 0).

    Returns:
        float32 ``[T, S, R]``: the products for rows of a tile, zero for other rows and for
        columns at or past the rank. With split-K the float32 summation order varies
        between runs.

    Raises:
        ValueError: 0 or more than 3 slices, slices of another dtype/device/shape, an
            unsupported dtype, a ``ranks`` that is not an int32 ``[max_loras, S]`` table
            view, tiles of another row count, or a ``block_m`` the kernels do not take.
    """
    if x.dtype not in LORA_DTYPES or x.dim() != 2:
        raise ValueError(f"lora_shrink: x must be 2-d float32/bf16/fp16, got {x.dtype}")
    check_stacks("lora_shrink", lora_a_stacked, x.dtype, x.device)
    stacks = [a.contiguous() for a in lora_a_stacked]
    max_loras, max_rank, k = stacks[0].shape
    if any(a.shape != stacks[0].shape for a in stacks) or k != x.shape[1]:
        raise ValueError(f"lora_shrink: A slices {[tuple(a.shape) for a in stacks]} do not all "
                         f"match [max_loras, max_lora_rank, {x.shape[1]}]")
    num_rows, num_slices = x.shape[0], len(stacks)
    check_table("lora_shrink", "ranks", ranks, max_loras, num_slices, x.device)
    _check_rows(num_rows, sorted_rows)
    out = torch.zeros(num_rows, num_slices, max_rank, dtype=torch.float32, device=x.device)
    num_tiles = tile_slot.shape[0]
    plan = tiled_shrink_plan(num_tiles, block_m, k, max_rank, num_slices, x.element_size(),
                             interpreted_bf16(x))
    if num_rows == 0 or max_rank == 0 or num_tiles == 0:
        return out
    a0, a1, a2 = (stacks + [stacks[0]] * MAX_SLICES)[:MAX_SLICES]
    lora_tiled_kernels.tiled_shrink_kernel[plan.grid](
        x, a0, a1, a2, out, ranks, sorted_rows, tile_slot, tile_start, tile_len, k,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        ranks.stride(0), rank_start, **plan.constexprs)
    return out


def lora_expand_tiled(y: torch.Tensor, buffer: torch.Tensor,
                      lora_b_stacked: Sequence[torch.Tensor], ranks: torch.Tensor,
                      sorted_rows: torch.Tensor, tile_slot: torch.Tensor,
                      tile_start: torch.Tensor, tile_len: torch.Tensor, block_m: int,
                      slice_offsets: Sequence[int], dora: torch.Tensor | None = None,
                      dora_scale_stacked: Sequence[torch.Tensor] | None = None,
                      bias: torch.Tensor | None = None) -> None:
    """``y[t, off_s : off_s + out_s] += buffer[t, s, :r] @ B_s[slot, :r]`` in place over the
    step's row tiles, all slices in one launch, with DoRA's rescaling fused in
    (``lora_tiled_kernels``); registered as ``torch.ops.manylora.lora_expand_tiled``. A
    (slot, slice) with ``dora[slot, s] == 1`` (only when ``dora_scale_stacked`` is given)
    stores ``(y + delta) * scale + (1 - scale) * bias[cols]`` in float32, rounded once.

    Args:
        y: ``[T, out_total]``, float32, bfloat16 or float16; rows of no tile, columns of no
            slice and the rows of a (slot, slice) of rank 0 are left untouched.
        buffer: float32 ``[T, S, R]`` from ``lora_shrink_tiled``.
        lora_b_stacked: 1-3 contiguous rank-major ``[max_loras, R, out_s]`` tensors, dtype
            of ``y``; rank rows past a (slot, slice)'s rank are never read.
        ranks: int32 ``[max_loras, S]``, as ``lora_shrink_tiled``'s.
        sorted_rows, tile_slot, tile_start, tile_len, block_m: as ``lora_shrink_tiled``'s.
        slice_offsets: ``S`` column offsets into ``y``; the slices must not overlap.
        dora: int32 ``[max_loras, S]``, the table's DoRA flags; needed with scales.
        dora_scale_stacked: None, or ``S`` float32 ``[max_loras, out_s]`` DoRA scales
            ``m / ||W + BA||`` (read only where flagged).
        bias: None, or contiguous ``[out_total]`` of ``y``'s dtype, the bias ``y`` includes
            (only with scales).

    The buffer tile is rounded to ``y``'s dtype before its ``tl.dot`` (as Punica and vLLM
    do); the sum with ``y`` is float32, rounded once.

    Raises:
        ValueError: 0 or more than 3 slices, slices of another dtype/device/rank, offsets
            that do not fit ``y`` or overlap, a buffer of the wrong shape, tiles of another
            row count, a ``ranks`` / ``dora`` that is not an int32 ``[max_loras, S]`` table
            view, scales of another shape, a bias without scales or not ``[out_total]`` of
            ``y``'s dtype, or a ``block_m`` the kernels do not take.
    """
    if y.dtype not in LORA_DTYPES or y.dim() != 2:
        raise ValueError(f"lora_expand: y must be 2-d float32/bf16/fp16, got {y.dtype}")
    check_stacks("lora_expand", lora_b_stacked, y.dtype, y.device)
    stacks = [b.contiguous() for b in lora_b_stacked]
    num_rows, num_slices = y.shape[0], len(stacks)
    max_loras, max_rank, _ = stacks[0].shape
    if buffer.shape != (num_rows, num_slices, max_rank) or buffer.dtype != torch.float32:
        raise ValueError(f"lora_expand: buffer {tuple(buffer.shape)} {buffer.dtype}, expected "
                         f"float32 {(num_rows, num_slices, max_rank)}")
    sizes = [b.shape[2] for b in stacks]
    spans = sorted(zip(slice_offsets, sizes))
    if (len(slice_offsets) != num_slices
            or any(b.shape[:2] != (max_loras, max_rank) for b in stacks)
            or spans[0][0] < 0 or spans[-1][0] + spans[-1][1] > y.shape[1]
            or any(o1 + n1 > o2 for (o1, n1), (o2, _) in zip(spans, spans[1:]))):
        raise ValueError(f"lora_expand: B slices {[tuple(b.shape) for b in stacks]} at offsets "
                         f"{list(slice_offsets)} do not fit y's {y.shape[1]} columns")
    check_table("lora_expand", "ranks", ranks, max_loras, num_slices, y.device)
    _check_rows(num_rows, sorted_rows)
    has_dora = dora_scale_stacked is not None
    if has_dora:
        if dora is None:
            raise ValueError("lora_expand: DoRA scales need the table's dora flags")
        check_table("lora_expand", "dora", dora, max_loras, num_slices, y.device)
        want = [(max_loras, n) for n in sizes]
        if ([tuple(t.shape) for t in dora_scale_stacked] != want
                or any(t.dtype != torch.float32 or t.device != y.device
                       for t in dora_scale_stacked)):
            raise ValueError(f"lora_expand: DoRA scales "
                             f"{[tuple(t.shape) for t in dora_scale_stacked]}, expected "
                             f"float32 {want} on {y.device}")
    elif bias is not None:
        raise ValueError("lora_expand: a DoRA bias was given without DoRA scales")
    if bias is not None and (tuple(bias.shape) != (y.shape[1],) or bias.dtype != y.dtype
                             or bias.device != y.device):
        raise ValueError(f"lora_expand: DoRA bias {tuple(bias.shape)} {bias.dtype}, expected "
                         f"[{y.shape[1]}] {y.dtype} on {y.device}")
    num_tiles = tile_slot.shape[0]
    plan = tiled_expand_plan(num_tiles, block_m, max(sizes), max_rank, num_slices,
                             has_dora, bias is not None, interpreted_bf16(y))
    if num_rows == 0 or max_rank == 0 or num_tiles == 0:
        return
    b0, b1, b2 = (stacks + [stacks[0]] * MAX_SLICES)[:MAX_SLICES]
    n0, n1, n2 = (sizes + [0] * MAX_SLICES)[:MAX_SLICES]
    o0, o1, o2 = (list(slice_offsets) + [0] * MAX_SLICES)[:MAX_SLICES]
    scales = [t.contiguous() for t in dora_scale_stacked] if has_dora else [y]
    sc0, sc1, sc2 = (scales + [scales[0]] * MAX_SLICES)[:MAX_SLICES]
    flags = dora if has_dora else ranks
    lora_tiled_kernels.tiled_expand_kernel[plan.grid](
        buffer, b0, b1, b2, y, ranks, sorted_rows, tile_slot, tile_start, tile_len,
        flags, sc0, sc1, sc2, y if bias is None else bias.contiguous(),
        n0, n1, n2, o0, o1, o2, plan.n_tiles,
        buffer.stride(0), buffer.stride(1), y.stride(0), y.stride(1), ranks.stride(0),
        flags.stride(0), **plan.constexprs)


def _lora_shrink_tiled_fake(x, lora_a_stacked, ranks, sorted_rows, tile_slot, tile_start,
                            tile_len, block_m, rank_start=0):
    return x.new_empty((x.shape[0], len(lora_a_stacked), lora_a_stacked[0].shape[1]),
                       dtype=torch.float32)


def _lora_expand_tiled_fake(y, buffer, lora_b_stacked, ranks, sorted_rows, tile_slot,
                            tile_start, tile_len, block_m, slice_offsets, dora=None,
                            dora_scale_stacked=None, bias=None):
    return None


#: Dispatcher schemas (``torch.ops.manylora.lora_shrink_tiled`` / ``lora_expand_tiled``),
#: registered with their fake kernels by ``lora/kernels/triton_lora.py``.
LORA_SHRINK_TILED_SCHEMA = (
    "(Tensor x, Tensor[] lora_a_stacked, Tensor ranks, Tensor sorted_rows, Tensor tile_slot, "
    "Tensor tile_start, Tensor tile_len, SymInt block_m, SymInt rank_start=0) -> Tensor")
LORA_EXPAND_TILED_SCHEMA = (
    "(Tensor(a0!) y, Tensor buffer, Tensor[] lora_b_stacked, Tensor ranks, "
    "Tensor sorted_rows, Tensor tile_slot, Tensor tile_start, Tensor tile_len, "
    "SymInt block_m, SymInt[] slice_offsets, Tensor? dora=None, "
    "Tensor[]? dora_scale_stacked=None, Tensor? bias=None) -> ()")
