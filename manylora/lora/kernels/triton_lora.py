"""The LoRA shrink/expand ops: Punica's SGMV/BGMV launches, checked, and their registration.

``lora_shrink_op`` / ``lora_expand_op`` validate their arguments and launch one kernel of
``manylora.lora.kernels.sgmv_kernels`` (Punica, Chen et al. 2023; vLLM's punica Triton ops) sized by
``manylora.lora.kernels.plans``. The variant is the mapping's: ``"sgmv"`` (rows grouped by
slot), ``"bgmv"`` (a gather per row) or ``"tiled"`` (each slot's rows in tiles of at most
``block_m``, each adapter read once per tile: ``lora/kernels/triton_lora_tiled.py``, registered here
as ``torch.ops.manylora.lora_shrink_tiled`` / ``lora_expand_tiled``).

The ops are CUDA-graph safe: no host synchronisation, grids only from tensor shapes and the
mapping's host ints. Both are registered directly with the dispatcher
(``torch.ops.manylora.lora_shrink`` / ``lora_expand``, a ``torch.library.Library``
definition with fake kernels, for ``torch.compile``); eager callers skip the dispatcher (see
``lora_shrink_triton``). They run on any device Triton runs on, including CPU tensors under
``TRITON_INTERPRET=1``.

The slot buffers are expected as ``LoRASlots`` lays them out: contiguous (others are copied
first), A ``[max_loras, R, in]`` and B rank-major ``[max_loras, R, out_s]``. Each
(slot, slice)'s rank and DoRA flag come from the model's ``SlotTable`` (``ranks`` / ``dora``,
int32 ``[max_loras, S]`` views with unit column stride); no kernel reads A or B past the
rank, and a (slot, slice) of rank 0 reads nothing at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from manylora.lora.kernels import sgmv_kernels as lora_kernels
from manylora.lora.kernels import triton_lora_tiled
from manylora.lora.kernels.checks import LORA_DTYPES, check_stacks, check_table
from manylora.lora.kernels.meta import LoRAKernelMeta
from manylora.lora.kernels.plans import MAX_SLICES, expand_plan, interpreted_bf16, shrink_plan
from manylora.lora.kernels.triton_lora_tiled import lora_expand_tiled, lora_shrink_tiled


def _check_mapping(num_rows: int, token_lora_indices: torch.Tensor, variant: str) -> None:
    if token_lora_indices.shape[0] != num_rows:
        raise ValueError(f"the mapping has {token_lora_indices.shape[0]} rows, the activations "
                         f"{num_rows}")
    if variant not in ("sgmv", "bgmv"):
        raise ValueError(f"unknown LoRA kernel variant {variant!r}: use 'sgmv' or 'bgmv'")


# ---------------------------------------------------------------------------------------------
# the ops (plain functions; registered with the dispatcher below)


def lora_shrink_op(x: torch.Tensor, lora_a_stacked: list[torch.Tensor], ranks: torch.Tensor,
                   token_lora_indices: torch.Tensor, sorted_rows: torch.Tensor,
                   active_slots: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
                   max_seg_len: int, variant: str, rank_start: int = 0) -> torch.Tensor:
    """``buffer[t, s, :c] = x[t] @ A_s[slot[t], :c]^T`` with ``c = clamp(ranks[slot[t], s]
    - rank_start, 0, R)``, in one Triton launch (Punica SGMV/BGMV); registered as
    ``torch.ops.manylora.lora_shrink``.

    Args:
        x: ``[T, in]``, float32, bfloat16 or float16.
        lora_a_stacked: 1-3 contiguous ``[max_loras, R, in]`` tensors, dtype of ``x``; rows
            past each (slot, slice)'s rank are never read.
        ranks: int32 ``[max_loras, S]``, the projection's columns of the ``SlotTable``.
        token_lora_indices, sorted_rows, active_slots, seg_start, seg_len, max_seg_len,
            variant: the fields of the step's ``LoRAKernelMeta``.
        rank_start: the first rank row A holds (fully sharded column parallelism; else 0).

    Returns:
        float32 ``[T, S, R]``: the products for rows with a slot, zero for base rows and
        for columns at or past each (slot, slice)'s rank. Accumulated in float32 (fp32
        inputs without TF32); with split-K the summation order varies between runs.

    Raises:
        ValueError: 0 or more than 3 slices, a slice of another dtype/device/width, an
            unsupported dtype, a ``ranks`` that is not an int32 ``[max_loras, S]`` table
            view, a mapping of another row count, or an unknown variant.
    """
    if x.dtype not in LORA_DTYPES or x.dim() != 2:
        raise ValueError(f"lora_shrink: x must be 2-d float32/bf16/fp16, got {x.dtype}")
    check_stacks("lora_shrink", lora_a_stacked, x.dtype, x.device)
    _check_mapping(x.shape[0], token_lora_indices, variant)
    stacks = [a.contiguous() for a in lora_a_stacked]
    max_loras, max_rank, k = stacks[0].shape
    if any(a.shape != stacks[0].shape for a in stacks) or k != x.shape[1]:
        raise ValueError(f"lora_shrink: A slices {[tuple(a.shape) for a in stacks]} do not all "
                         f"match [max_loras, max_lora_rank, {x.shape[1]}]")
    num_rows, num_slices = x.shape[0], len(stacks)
    check_table("lora_shrink", "ranks", ranks, max_loras, num_slices, x.device)
    out = torch.zeros(num_rows, num_slices, max_rank, dtype=torch.float32, device=x.device)
    if num_rows == 0 or max_rank == 0:
        return out
    if variant == "sgmv" and max_seg_len == 0:
        return out
    a0, a1, a2 = (stacks + [stacks[0]] * MAX_SLICES)[:MAX_SLICES]
    plan = shrink_plan(variant, num_rows, max_seg_len, max_loras, k, max_rank, num_slices,
                       x.element_size(), interpreted_bf16(x))
    args = (k, plan.k_per_split, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            ranks.stride(0), rank_start)
    if variant == "sgmv":
        lora_kernels.sgmv_shrink_kernel[plan.grid](
            x, a0, a1, a2, out, ranks, sorted_rows, active_slots, seg_start, seg_len, *args,
            **plan.constexprs)
    else:
        lora_kernels.bgmv_shrink_kernel[plan.grid](
            x, a0, a1, a2, out, token_lora_indices, ranks, *args, **plan.constexprs)
    return out


def _lora_shrink_fake(x, lora_a_stacked, ranks, token_lora_indices, sorted_rows, active_slots,
                      seg_start, seg_len, max_seg_len, variant, rank_start=0):
    return x.new_empty((x.shape[0], len(lora_a_stacked), lora_a_stacked[0].shape[1]),
                       dtype=torch.float32)


def _check_dora(dora: torch.Tensor | None, scales: Sequence[torch.Tensor] | None,
                bias: torch.Tensor | None, sizes: Sequence[int], max_loras: int,
                y: torch.Tensor) -> None:
    """Validate the DoRA arguments of ``lora_expand_op`` (all None: no DoRA).

    Raises:
        ValueError: a bias without scales, scales without ``dora`` flags, flags that are not
            an int32 ``[max_loras, S]`` table view on ``y``'s device, scale stacks that are
            not one float32 ``[max_loras, out_s]`` tensor on that device per slice, or a
            bias that is not ``[y columns]`` of ``y``'s dtype there.
    """
    if scales is None:
        if bias is not None:
            raise ValueError("lora_expand: a DoRA bias was given without DoRA scales")
        return
    if dora is None:
        raise ValueError("lora_expand: DoRA scales need the table's dora flags")
    check_table("lora_expand", "dora", dora, max_loras, len(sizes), y.device)
    want = [(max_loras, n) for n in sizes]
    if (len(scales) != len(sizes) or [tuple(t.shape) for t in scales] != want
            or any(t.dtype != torch.float32 or t.device != y.device for t in scales)):
        raise ValueError(f"lora_expand: DoRA scales {[tuple(t.shape) for t in scales]} "
                         f"{[t.dtype for t in scales]}, expected float32 {want} on {y.device}")
    if bias is not None and (tuple(bias.shape) != (y.shape[1],) or bias.dtype != y.dtype
                             or bias.device != y.device or bias.stride(0) != 1):
        raise ValueError(f"lora_expand: bias {tuple(bias.shape)} {bias.dtype} on "
                         f"{bias.device}, expected contiguous {y.dtype} ({y.shape[1]},) on "
                         f"{y.device}")


def _dora_launch_args(y: torch.Tensor, dora: torch.Tensor | None,
                      scales: Sequence[torch.Tensor] | None, bias: torch.Tensor | None) -> list:
    """The pointer arguments of the expand kernels' DoRA epilogue: the flags, three scale
    pointers (padded with the first: a compiled kernel needs one element type per argument
    group) and the bias; ``y`` where absent (``HAS_DORA`` / ``HAS_SHIFT`` say what is
    read)."""
    sc = [y] * MAX_SLICES
    if scales is not None:
        sc = [t.contiguous() for t in scales]
        sc = (sc + [sc[0]] * MAX_SLICES)[:MAX_SLICES]
    return [y if dora is None else dora, *sc, y if bias is None else bias]


def lora_expand_op(y: torch.Tensor, buffer: torch.Tensor, lora_b_stacked: list[torch.Tensor],
                   ranks: torch.Tensor, token_lora_indices: torch.Tensor,
                   sorted_rows: torch.Tensor, active_slots: torch.Tensor,
                   seg_start: torch.Tensor, seg_len: torch.Tensor, max_seg_len: int,
                   variant: str, slice_offsets: list[int], dora: torch.Tensor | None = None,
                   dora_scale_stacked: list[torch.Tensor] | None = None,
                   bias: torch.Tensor | None = None) -> None:
    """``y[t, off_s : off_s + out_s] += buffer[t, s, :r] @ B_s[slot[t], :r]`` with
    ``r = ranks[slot[t], s]``, in place, in one Triton launch (Punica SGMV/BGMV expand), with
    DoRA's rescaling fused in; registered as ``torch.ops.manylora.lora_expand``.

    For a row whose (slot, slice) has ``dora[slot, s] == 1`` (only when
    ``dora_scale_stacked`` is given), the slice's columns become instead::

        y[t, cols] = (y[t, cols] + delta) * scale_s[slot] + (1 - scale_s[slot]) * bias[cols]

    (no bias term without ``bias``), computed in float32 and rounded once to ``y``'s dtype.
    Other LoRA rows get exactly what a launch without DoRA arguments gives them; rows of a
    (slot, slice) of rank 0 are not read or written.

    Args:
        y: ``[T, out_total]``, float32, bfloat16 or float16; updated in place, rows with slot
            -1 and columns of no slice left untouched.
        buffer: float32 ``[T, S, R]`` from ``lora_shrink``.
        lora_b_stacked: 1-3 contiguous rank-major ``[max_loras, R, out_s]`` tensors, dtype
            of ``y``; rows past each (slot, slice)'s rank are never read.
        ranks: int32 ``[max_loras, S]``, the projection's columns of the ``SlotTable``.
        token_lora_indices, sorted_rows, active_slots, seg_start, seg_len, max_seg_len,
            variant: the fields of the step's ``LoRAKernelMeta``.
        slice_offsets: ``S`` column offsets ``off_s`` into ``y``; the slices must not overlap.
        dora: int32 ``[max_loras, S]``, the table's DoRA flags; needed with DoRA scales.
        dora_scale_stacked: None, or ``S`` float32 ``[max_loras, out_s]``, the DoRA scales
            ``m / ||W + BA||`` of each slot (read only where flagged).
        bias: None, or contiguous ``[out_total]`` of ``y``'s dtype, the bias ``y`` includes
            (only with scales).

    The SGMV variant rounds each buffer tile to ``y``'s dtype before its ``tl.dot`` (as
    Punica and vLLM do); BGMV multiplies in float32. Either adds in float32 and rounds once.

    Raises:
        ValueError: 0 or more than 3 slices, slices of another dtype/device/rank, offsets
            that do not match the slices or make them overlap or overflow ``y``, a buffer
            of the wrong shape, a ``ranks`` that is not an int32 ``[max_loras, S]`` table
            view, a mapping of another row count, an unknown variant, or DoRA arguments as
            ``_check_dora`` rejects them.
    """
    if y.dtype not in LORA_DTYPES or y.dim() != 2:
        raise ValueError(f"lora_expand: y must be 2-d float32/bf16/fp16, got {y.dtype}")
    check_stacks("lora_expand", lora_b_stacked, y.dtype, y.device)
    _check_mapping(y.shape[0], token_lora_indices, variant)
    stacks = [b.contiguous() for b in lora_b_stacked]
    num_rows, num_slices = y.shape[0], len(stacks)
    max_loras, max_rank, _ = stacks[0].shape
    if buffer.shape != (num_rows, num_slices, max_rank) or buffer.dtype != torch.float32:
        raise ValueError(f"lora_expand: buffer {tuple(buffer.shape)} {buffer.dtype}, expected "
                         f"float32 {(num_rows, num_slices, max_rank)}")
    if len(slice_offsets) != num_slices:
        raise ValueError(f"{len(slice_offsets)} output slices for {num_slices} B stacks")
    sizes = [b.shape[2] for b in stacks]
    spans = sorted(zip(slice_offsets, sizes))
    if (any(b.shape[0] != max_loras or b.shape[1] != max_rank for b in stacks)
            or spans[0][0] < 0 or spans[-1][0] + spans[-1][1] > y.shape[1]
            or any(o1 + n1 > o2 for (o1, n1), (o2, _) in zip(spans, spans[1:]))):
        raise ValueError(f"lora_expand: B slices {[tuple(b.shape) for b in stacks]} at offsets "
                         f"{list(slice_offsets)} do not fit y's {y.shape[1]} columns")
    check_table("lora_expand", "ranks", ranks, max_loras, num_slices, y.device)
    _check_dora(dora, dora_scale_stacked, bias, sizes, max_loras, y)
    if num_rows == 0 or max_rank == 0:
        return
    if variant == "sgmv" and max_seg_len == 0:
        return
    b0, b1, b2 = (stacks + [stacks[0]] * MAX_SLICES)[:MAX_SLICES]
    n0, n1, n2 = (sizes + [0] * MAX_SLICES)[:MAX_SLICES]
    o0, o1, o2 = (list(slice_offsets) + [0] * MAX_SLICES)[:MAX_SLICES]
    has_dora = dora_scale_stacked is not None
    dora_args = _dora_launch_args(y, dora, dora_scale_stacked, bias)
    plan = expand_plan(variant, num_rows, max_seg_len, max_loras, max(sizes), max_rank,
                       num_slices, has_dora, bias is not None, interpreted_bf16(y))
    strides = (buffer.stride(0), buffer.stride(1), y.stride(0), y.stride(1), ranks.stride(0),
               dora.stride(0) if has_dora else 0)
    if variant == "sgmv":
        lora_kernels.sgmv_expand_kernel[plan.grid](
            buffer, b0, b1, b2, y, ranks, sorted_rows, active_slots, seg_start, seg_len,
            *dora_args, n0, n1, n2, o0, o1, o2, plan.n_tiles, *strides, **plan.constexprs)
    else:
        lora_kernels.bgmv_expand_kernel[plan.grid](
            buffer, b0, b1, b2, y, token_lora_indices, ranks, *dora_args,
            n0, n1, n2, o0, o1, o2, *strides, **plan.constexprs)


def _lora_expand_fake(y, buffer, lora_b_stacked, ranks, token_lora_indices, sorted_rows,
                      active_slots, seg_start, seg_len, max_seg_len, variant, slice_offsets,
                      dora=None, dora_scale_stacked=None, bias=None):
    return None


# ---------------------------------------------------------------------------------------------
# registration: torch.ops.manylora.lora_shrink / lora_expand

_LORA_SHRINK_SCHEMA = (
    "(Tensor x, Tensor[] lora_a_stacked, Tensor ranks, Tensor token_lora_indices, "
    "Tensor sorted_rows, Tensor active_slots, Tensor seg_start, Tensor seg_len, "
    "SymInt max_seg_len, str variant, SymInt rank_start=0) -> Tensor")
_LORA_EXPAND_SCHEMA = (
    "(Tensor(a0!) y, Tensor buffer, Tensor[] lora_b_stacked, Tensor ranks, "
    "Tensor token_lora_indices, Tensor sorted_rows, Tensor active_slots, Tensor seg_start, "
    "Tensor seg_len, SymInt max_seg_len, str variant, SymInt[] slice_offsets, "
    "Tensor? dora=None, Tensor[]? dora_scale_stacked=None, Tensor? bias=None) -> ()")

#: The ``manylora`` operator namespace. Ops are defined on it directly (``define`` +
#: ``impl`` + a fake kernel), as vLLM's ``direct_register_custom_op`` does: a call through
#: ``torch.ops`` then costs one dispatcher hop, where ``torch.library.custom_op`` adds a
#: Python layer of its own (schema inference, mutation and alias checks) to every call.
LIBRARY = torch.library.Library("manylora", "FRAGMENT")


def _register(name: str, schema: str, impl, fake) -> None:
    """``manylora::<name>``: ``impl`` for every backend (CompositeExplicitAutograd: the Triton
    wrappers run on CUDA, and on CPU under the interpreter) and ``fake`` for FakeTensor /
    meta tracing (``torch.compile``)."""
    LIBRARY.define(name + schema)
    LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"manylora::{name}", fake, lib=LIBRARY)


_register("lora_shrink", _LORA_SHRINK_SCHEMA, lora_shrink_op, _lora_shrink_fake)
_register("lora_expand", _LORA_EXPAND_SCHEMA, lora_expand_op, _lora_expand_fake)
_register("lora_shrink_tiled", triton_lora_tiled.LORA_SHRINK_TILED_SCHEMA, lora_shrink_tiled,
          triton_lora_tiled._lora_shrink_tiled_fake)
_register("lora_expand_tiled", triton_lora_tiled.LORA_EXPAND_TILED_SCHEMA, lora_expand_tiled,
          triton_lora_tiled._lora_expand_tiled_fake)


# ---------------------------------------------------------------------------------------------
# entry points taking a LoRAKernelMeta


def lora_shrink_triton(x: torch.Tensor, lora_a_stacked: Sequence[torch.Tensor],
                       ranks: torch.Tensor, lora_meta: LoRAKernelMeta, *,
                       rank_start: int = 0) -> torch.Tensor:
    """``buffer[t, s, :] = x[t] @ A_s[slot[t]]^T`` for every slice, up to each (slot,
    slice)'s rank, in one launch of Punica's SGMV or BGMV shrink or the tiled shrink
    (``lora_meta.variant``): ``lora_shrink_op`` / ``lora_shrink_tiled`` with the mapping's
    fields.

    Eager calls (CUDA-graph capture included: a graph records the launches, whatever Python
    made them) call ``lora_shrink_op`` directly, skipping the dispatcher hop a
    ``torch.ops`` call costs (``benchmarks/bench_op_dispatch.py`` measures both); under
    ``torch.compile`` tracing the call goes through ``torch.ops.manylora.lora_shrink``,
    whose fake kernel Dynamo and Inductor see instead of the Triton wrapper.

    Args:
        x: ``[T, in]`` activations (float32, bfloat16 or float16).
        lora_a_stacked: 1-3 tensors ``[max_loras, R, in]``, dtype of ``x``.
        ranks: int32 ``[max_loras, S]``, the projection's columns of the ``SlotTable``.
        lora_meta: the step's token → slot map, on ``x``'s device.
        rank_start: the first rank row A holds (fully sharded column parallelism).

    Returns:
        float32 ``[T, S, R]``; zero for base rows and past each rank. Without a LoRA row
        (``lora_meta.has_lora`` False) the zero buffer, no kernel launched.

    Raises:
        ValueError: as ``lora_shrink_op``.
    """
    if not lora_meta.has_lora:
        return torch.zeros(x.shape[0], len(lora_a_stacked), lora_a_stacked[0].shape[1],
                           dtype=torch.float32, device=x.device)
    if lora_meta.variant == "tiled":
        op = (torch.ops.manylora.lora_shrink_tiled if torch.compiler.is_compiling()
              else lora_shrink_tiled)
        return op(x, list(lora_a_stacked), ranks, *_row_tiles(lora_meta), rank_start)
    op = torch.ops.manylora.lora_shrink if torch.compiler.is_compiling() else lora_shrink_op
    return op(x, list(lora_a_stacked), ranks, lora_meta.token_lora_indices, lora_meta.sorted_rows,
              lora_meta.active_slots, lora_meta.seg_start, lora_meta.seg_len, lora_meta.max_seg_len,
              lora_meta.variant, rank_start)


def lora_expand_triton(y: torch.Tensor, buffer: torch.Tensor,
                       lora_b_stacked: Sequence[torch.Tensor], ranks: torch.Tensor,
                       lora_meta: LoRAKernelMeta, output_slices: Sequence[tuple[int, int]],
                       dora: torch.Tensor | None = None,
                       dora_scale_stacked: Sequence[torch.Tensor] | None = None,
                       bias: torch.Tensor | None = None) -> None:
    """``y[t, off_s : off_s + out_s] += buffer[t, s, :r] @ B_s[slot[t], :r]`` for every
    slice, in place, in one launch of Punica's SGMV or BGMV expand or the tiled expand
    (``lora_meta.variant``): ``lora_expand_op`` / ``lora_expand_tiled`` with the mapping's
    fields, called directly when eager and through ``torch.ops.manylora`` under
    ``torch.compile`` (see ``lora_shrink_triton``).

    With ``dora_scale_stacked``, rows whose (slot, slice) the table flags in ``dora`` get
    ``y[t, cols] = (y[t, cols] + delta) * scale + (1 - scale) * bias[cols]`` instead
    (float32, rounded once); ranks and flags are read by the kernels, so the launch is the
    same whichever adapters the slots hold (CUDA-graph safe).

    Args:
        y: ``[T, out_total]``, updated in place.
        buffer: float32 ``[T, S, R]`` from ``lora_shrink``.
        lora_b_stacked: 1-3 rank-major tensors ``[max_loras, R, out_s]``, dtype of ``y``.
        ranks: int32 ``[max_loras, S]``; dora: int32 ``[max_loras, S]`` (with scales).
        lora_meta: the step's token → slot map, on ``y``'s device.
        output_slices: ``S`` pairs ``(offset, out_s)``; ``out_s`` must be B_s's width.
        dora_scale_stacked: None, or ``S`` float32 ``[max_loras, out_s]`` DoRA scales.
        bias: None, or ``[out_total]``, the bias in ``y`` (only with scales).

    Raises:
        ValueError: ``output_slices`` and ``lora_b_stacked`` disagree (count or widths), or
            as ``lora_expand_op``.
    """
    if len(output_slices) != len(lora_b_stacked):
        raise ValueError(
            f"{len(output_slices)} output slices for {len(lora_b_stacked)} B stacks")
    if any(n != b.shape[2] for (_, n), b in zip(output_slices, lora_b_stacked)):
        raise ValueError(f"output slices {list(output_slices)} do not match the B widths "
                         f"{[b.shape[2] for b in lora_b_stacked]}")
    if not lora_meta.has_lora:
        return
    scales = None if dora_scale_stacked is None else list(dora_scale_stacked)
    flags = dora if scales is not None else None
    offsets = [offset for offset, _ in output_slices]
    if lora_meta.variant == "tiled":
        op = (torch.ops.manylora.lora_expand_tiled if torch.compiler.is_compiling()
              else lora_expand_tiled)
        op(y, buffer, list(lora_b_stacked), ranks, *_row_tiles(lora_meta), offsets, flags,
           scales, bias)
        return
    op = torch.ops.manylora.lora_expand if torch.compiler.is_compiling() else lora_expand_op
    op(y, buffer, list(lora_b_stacked), ranks, lora_meta.token_lora_indices, lora_meta.sorted_rows,
       lora_meta.active_slots, lora_meta.seg_start, lora_meta.seg_len, lora_meta.max_seg_len,
       lora_meta.variant, offsets, flags, scales, bias)


def _row_tiles(lora_meta: LoRAKernelMeta) -> tuple:
    """The tiled ops' mapping arguments: ``sorted_rows``, the tile arrays, ``block_m``."""
    return (lora_meta.sorted_rows, lora_meta.tile_slot, lora_meta.tile_start, lora_meta.tile_len,
            lora_meta.block_m)
