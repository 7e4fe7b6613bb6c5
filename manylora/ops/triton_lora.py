"""The LoRA shrink/expand ops: Punica's SGMV/BGMV launches, checked, and their registration.

``lora_shrink_op`` / ``lora_expand_op`` validate their arguments and launch one kernel of
``manylora.ops.lora_kernels`` (Punica, Chen et al. 2023; vLLM's punica Triton ops) sized by
``manylora.ops.lora_plans``. The schedule is the mapping's: ``"sgmv"`` (rows grouped by
slot, prefill) or ``"bgmv"`` (a gather per row, decode).

The ops are CUDA-graph safe: no host synchronisation, grids only from tensor shapes and the
mapping's host ints. Both are registered directly with the dispatcher
(``torch.ops.manylora.lora_shrink`` / ``lora_expand``, a ``torch.library.Library``
definition with fake kernels, for ``torch.compile``); eager callers skip the dispatcher (see
``lora_shrink_triton``). They run on any device Triton runs on, including CPU tensors under
``TRITON_INTERPRET=1``.

The slot buffers are expected as ``LoRASlots`` lays them out: contiguous (others are copied
first), and zero (at least finite) past each slot's rank. Shrink never reads A past the
rank; expand reads B up to the rank rounded up to ``gcd(max_lora_rank, 8)`` so that its
loads along the rank stay vectorized.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from manylora.lora.punica import LoRAMapping
from manylora.ops import lora_kernels, triton_lora_tiled
from manylora.ops.lora_plans import MAX_SLICES, expand_plan, interpreted_bf16, shrink_plan
from manylora.ops.triton_lora_tiled import lora_expand_tiled, lora_shrink_tiled

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_stacks(name: str, stacks: Sequence[torch.Tensor], dtype: torch.dtype,
                  device: torch.device) -> None:
    if not 1 <= len(stacks) <= MAX_SLICES:
        raise ValueError(f"{name}: {len(stacks)} slices, the kernels take 1 to {MAX_SLICES}")
    for t in stacks:
        if t.dim() != 3 or t.dtype != dtype or t.device != device:
            raise ValueError(f"{name}: expected 3-d {dtype} tensors on {device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")


def _check_mapping(num_rows: int, token_lora_indices: torch.Tensor, schedule: str) -> None:
    if token_lora_indices.shape[0] != num_rows:
        raise ValueError(f"the mapping has {token_lora_indices.shape[0]} rows, the activations "
                         f"{num_rows}")
    if schedule not in ("sgmv", "bgmv"):
        raise ValueError(f"unknown LoRA kernel schedule {schedule!r}: use 'sgmv' or 'bgmv'")


# ---------------------------------------------------------------------------------------------
# the ops (plain functions; registered with the dispatcher below)


def lora_shrink_op(x: torch.Tensor, lora_a_stacked: list[torch.Tensor],
                   token_lora_indices: torch.Tensor, slot_ranks: torch.Tensor,
                   sorted_rows: torch.Tensor, active_slots: torch.Tensor,
                   seg_start: torch.Tensor, seg_len: torch.Tensor, max_seg_len: int,
                   schedule: str) -> torch.Tensor:
    """``buffer[t, s, :] = x[t] @ A_s[slot[t]]^T`` in one Triton launch (Punica SGMV/BGMV);
    registered as ``torch.ops.manylora.lora_shrink``.

    Args:
        x: ``[T, in]``, float32, bfloat16 or float16.
        lora_a_stacked: 1-3 contiguous ``[max_loras, max_lora_rank, in]`` tensors, dtype of
            ``x``; zero past each slot's rank.
        token_lora_indices, slot_ranks, sorted_rows, active_slots, seg_start, seg_len,
            max_seg_len, schedule: the fields of the step's ``LoRAMapping``.

    Returns:
        float32 ``[T, S, max_lora_rank]``: the products for rows with a slot, zero for base
        rows and for columns at or past each slot's rank. Accumulated in float32 (fp32
        inputs without TF32); with split-K the summation order varies between runs.

    Raises:
        ValueError: 0 or more than 3 slices, a slice of another dtype/device/width, an
            unsupported dtype, a mapping of another row count, or an unknown schedule.
    """
    if x.dtype not in _DTYPES or x.dim() != 2:
        raise ValueError(f"lora_shrink: x must be 2-d float32/bf16/fp16, got {x.dtype}")
    _check_stacks("lora_shrink", lora_a_stacked, x.dtype, x.device)
    _check_mapping(x.shape[0], token_lora_indices, schedule)
    stacks = [a.contiguous() for a in lora_a_stacked]
    max_loras, max_rank, k = stacks[0].shape
    if any(a.shape != stacks[0].shape for a in stacks) or k != x.shape[1]:
        raise ValueError(f"lora_shrink: A slices {[tuple(a.shape) for a in stacks]} do not all "
                         f"match [max_loras, max_lora_rank, {x.shape[1]}]")
    num_rows, num_slices = x.shape[0], len(stacks)
    out = torch.zeros(num_rows, num_slices, max_rank, dtype=torch.float32, device=x.device)
    if num_rows == 0 or max_rank == 0:
        return out
    if schedule == "sgmv" and max_seg_len == 0:
        return out
    a0, a1, a2 = (stacks + [stacks[0]] * MAX_SLICES)[:MAX_SLICES]
    plan = shrink_plan(schedule, num_rows, max_seg_len, max_loras, k, max_rank, num_slices,
                       x.element_size(), interpreted_bf16(x))
    strides = (x.stride(0), x.stride(1), out.stride(0), out.stride(1))
    if schedule == "sgmv":
        lora_kernels.sgmv_shrink_kernel[plan.grid](
            x, a0, a1, a2, out, slot_ranks, sorted_rows, active_slots, seg_start, seg_len,
            k, plan.k_per_split, *strides, **plan.constexprs)
    else:
        lora_kernels.bgmv_shrink_kernel[plan.grid](
            x, a0, a1, a2, out, token_lora_indices, slot_ranks, k, plan.k_per_split, *strides,
            **plan.constexprs)
    return out


def _lora_shrink_fake(x, lora_a_stacked, token_lora_indices, slot_ranks, sorted_rows,
                      active_slots, seg_start, seg_len, max_seg_len, schedule):
    return x.new_empty((x.shape[0], len(lora_a_stacked), lora_a_stacked[0].shape[1]),
                       dtype=torch.float32)


def _check_dora(slot_dora: torch.Tensor | None, scales: Sequence[torch.Tensor] | None,
                shifts: Sequence[torch.Tensor] | None, sizes: Sequence[int], max_loras: int,
                device: torch.device) -> None:
    """Validate the DoRA arguments of ``lora_expand_op`` (all None: no DoRA).

    Raises:
        ValueError: shifts without scales, scales without ``slot_dora``, a ``slot_dora`` that
            is not int32 ``[max_loras]`` on ``device``, or scale/shift stacks that are not
            one float32 ``[max_loras, out_s]`` tensor on ``device`` per slice.
    """
    if scales is None:
        if shifts is not None:
            raise ValueError("lora_expand: DoRA shifts were given without DoRA scales")
        return
    if (slot_dora is None or slot_dora.dtype != torch.int32 or slot_dora.device != device
            or tuple(slot_dora.shape) != (max_loras,)):
        got = None if slot_dora is None else (tuple(slot_dora.shape), slot_dora.dtype)
        raise ValueError(f"lora_expand: DoRA scales need slot_dora as int32 [{max_loras}] on "
                         f"{device}, got {got}")
    want = [(max_loras, n) for n in sizes]
    for name, stacks in (("scales", scales), ("shifts", shifts)):
        if stacks is None:
            continue
        if (len(stacks) != len(sizes) or [tuple(t.shape) for t in stacks] != want
                or any(t.dtype != torch.float32 or t.device != device for t in stacks)):
            raise ValueError(f"lora_expand: DoRA {name} {[tuple(t.shape) for t in stacks]} "
                             f"{[t.dtype for t in stacks]}, expected float32 {want} on "
                             f"{device}")


def _pad_pointers(y: torch.Tensor, stacks: Sequence[torch.Tensor] | None) -> list:
    """``MAX_SLICES`` tensors for the kernel's pointer arguments: ``stacks`` padded with its
    first entry (a compiled kernel needs one element type per argument group), or ``y``
    throughout when there are none (the launch never reads them)."""
    if stacks is None:
        return [y] * MAX_SLICES
    stacks = [t.contiguous() for t in stacks]
    return (stacks + [stacks[0]] * MAX_SLICES)[:MAX_SLICES]


def _dora_launch_args(y: torch.Tensor, slot_dora: torch.Tensor | None,
                      scales: Sequence[torch.Tensor] | None,
                      shifts: Sequence[torch.Tensor] | None) -> list:
    """The pointer arguments of the expand kernels' DoRA epilogue: the flag, three scale and
    three shift pointers (``HAS_DORA`` / ``HAS_SHIFT`` say which are read)."""
    sc, sh = (_pad_pointers(y, t) for t in (scales, shifts))
    flag = y if scales is None else slot_dora
    return [flag, *sc, *sh]


def lora_expand_op(y: torch.Tensor, buffer: torch.Tensor, lora_b_stacked: list[torch.Tensor],
                   token_lora_indices: torch.Tensor, slot_ranks: torch.Tensor,
                   sorted_rows: torch.Tensor, active_slots: torch.Tensor,
                   seg_start: torch.Tensor, seg_len: torch.Tensor, max_seg_len: int,
                   schedule: str, slice_offsets: list[int],
                   slot_dora: torch.Tensor | None = None,
                   dora_scale_stacked: list[torch.Tensor] | None = None,
                   dora_shift_stacked: list[torch.Tensor] | None = None) -> None:
    """``y[t, off_s : off_s + out_s] += buffer[t, s] @ B_s[slot[t]]^T`` in place, in one
    Triton launch (Punica SGMV/BGMV expand), with DoRA's rescaling fused in; registered as
    ``torch.ops.manylora.lora_expand``.

    For a row whose slot has ``slot_dora[slot] == 1`` (only when ``dora_scale_stacked`` is
    given), the slice's columns become instead::

        y[t, cols] = (y[t, cols] + delta) * scale_s[slot] (+ shift_s[slot])

    computed in float32 and rounded once to ``y``'s dtype. Other LoRA rows get exactly what
    a launch without DoRA arguments gives them.

    Args:
        y: ``[T, out_total]``, float32, bfloat16 or float16; updated in place, rows with slot
            -1 and columns of no slice left untouched.
        buffer: float32 ``[T, S, max_lora_rank]`` from ``lora_shrink``.
        lora_b_stacked: 1-3 contiguous ``[max_loras, out_s, max_lora_rank]`` tensors, dtype
            of ``y``; zero (at least finite) past each slot's rank.
        token_lora_indices, slot_ranks, sorted_rows, active_slots, seg_start, seg_len,
            max_seg_len, schedule: the fields of the step's ``LoRAMapping``.
        slice_offsets: ``S`` column offsets ``off_s`` into ``y``; the slices must not overlap.
        slot_dora: int32 ``[max_loras]``, ``LoRAMapping.slot_dora``; needed with DoRA scales.
        dora_scale_stacked: None, or ``S`` float32 ``[max_loras, out_s]``, the DoRA scales
            ``m / ||W + BA||`` of each slot (read only for slots flagged in ``slot_dora``).
        dora_shift_stacked: None, or ``S`` float32 ``[max_loras, out_s]`` added after the
            scaling (``(1 - scale) * bias`` keeps the bias out of the scaling).

    The SGMV schedule rounds each buffer tile to ``y``'s dtype before its ``tl.dot`` (as
    Punica and vLLM do); BGMV multiplies in float32. Either adds in float32 and rounds once.

    Raises:
        ValueError: 0 or more than 3 slices, slices of another dtype/device/rank, offsets
            that do not match the slices or make them overlap or overflow ``y``, a buffer
            of the wrong shape, a mapping of another row count, an unknown schedule, or
            DoRA arguments as ``_check_dora`` rejects them.
    """
    if y.dtype not in _DTYPES or y.dim() != 2:
        raise ValueError(f"lora_expand: y must be 2-d float32/bf16/fp16, got {y.dtype}")
    _check_stacks("lora_expand", lora_b_stacked, y.dtype, y.device)
    _check_mapping(y.shape[0], token_lora_indices, schedule)
    stacks = [b.contiguous() for b in lora_b_stacked]
    num_rows, num_slices = y.shape[0], len(stacks)
    max_loras, _, max_rank = stacks[0].shape
    if buffer.shape != (num_rows, num_slices, max_rank) or buffer.dtype != torch.float32:
        raise ValueError(f"lora_expand: buffer {tuple(buffer.shape)} {buffer.dtype}, expected "
                         f"float32 {(num_rows, num_slices, max_rank)}")
    if len(slice_offsets) != num_slices:
        raise ValueError(f"{len(slice_offsets)} output slices for {num_slices} B stacks")
    sizes = [b.shape[1] for b in stacks]
    spans = sorted(zip(slice_offsets, sizes))
    if (any(b.shape[0] != max_loras or b.shape[2] != max_rank for b in stacks)
            or spans[0][0] < 0 or spans[-1][0] + spans[-1][1] > y.shape[1]
            or any(o1 + n1 > o2 for (o1, n1), (o2, _) in zip(spans, spans[1:]))):
        raise ValueError(f"lora_expand: B slices {[tuple(b.shape) for b in stacks]} at offsets "
                         f"{list(slice_offsets)} do not fit y's {y.shape[1]} columns")
    _check_dora(slot_dora, dora_scale_stacked, dora_shift_stacked, sizes, max_loras, y.device)
    if num_rows == 0 or max_rank == 0:
        return
    b0, b1, b2 = (stacks + [stacks[0]] * MAX_SLICES)[:MAX_SLICES]
    n0, n1, n2 = (sizes + [0] * MAX_SLICES)[:MAX_SLICES]
    o0, o1, o2 = (list(slice_offsets) + [0] * MAX_SLICES)[:MAX_SLICES]
    if schedule == "sgmv" and max_seg_len == 0:
        return
    dora_args = _dora_launch_args(y, slot_dora, dora_scale_stacked, dora_shift_stacked)
    plan = expand_plan(schedule, num_rows, max_seg_len, max_loras, max(sizes), max_rank,
                       num_slices, dora_scale_stacked is not None,
                       dora_shift_stacked is not None, interpreted_bf16(y))
    strides = (buffer.stride(0), buffer.stride(1), y.stride(0), y.stride(1))
    if schedule == "sgmv":
        lora_kernels.sgmv_expand_kernel[plan.grid](
            buffer, b0, b1, b2, y, slot_ranks, sorted_rows, active_slots, seg_start, seg_len,
            *dora_args, n0, n1, n2, o0, o1, o2, plan.n_tiles, *strides, **plan.constexprs)
    else:
        lora_kernels.bgmv_expand_kernel[plan.grid](
            buffer, b0, b1, b2, y, token_lora_indices, slot_ranks, *dora_args,
            n0, n1, n2, o0, o1, o2, *strides, **plan.constexprs)

def _lora_expand_fake(y, buffer, lora_b_stacked, token_lora_indices, slot_ranks, sorted_rows,
                      active_slots, seg_start, seg_len, max_seg_len, schedule, slice_offsets,
                      slot_dora=None, dora_scale_stacked=None, dora_shift_stacked=None):
    return None


# ---------------------------------------------------------------------------------------------
# registration: torch.ops.manylora.lora_shrink / lora_expand

_LORA_SHRINK_SCHEMA = (
    "(Tensor x, Tensor[] lora_a_stacked, Tensor token_lora_indices, Tensor slot_ranks, "
    "Tensor sorted_rows, Tensor active_slots, Tensor seg_start, Tensor seg_len, "
    "SymInt max_seg_len, str schedule) -> Tensor")
_LORA_EXPAND_SCHEMA = (
    "(Tensor(a0!) y, Tensor buffer, Tensor[] lora_b_stacked, Tensor token_lora_indices, "
    "Tensor slot_ranks, Tensor sorted_rows, Tensor active_slots, Tensor seg_start, "
    "Tensor seg_len, SymInt max_seg_len, str schedule, SymInt[] slice_offsets, "
    "Tensor? slot_dora=None, Tensor[]? dora_scale_stacked=None, "
    "Tensor[]? dora_shift_stacked=None) -> ()")

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
# entry points taking a LoRAMapping


def lora_shrink_triton(x: torch.Tensor, lora_a_stacked: Sequence[torch.Tensor],
                       mapping: LoRAMapping) -> torch.Tensor:
    """``buffer[t, s, :] = x[t] @ A_s[slot[t]]^T`` for every slice, in one launch of Punica's
    SGMV or BGMV shrink (``mapping.schedule``): ``lora_shrink_op`` with the mapping's fields.

    Eager calls (CUDA-graph capture included: a graph records the launches, whatever Python
    made them) call ``lora_shrink_op`` directly, skipping the dispatcher hop a
    ``torch.ops`` call costs (``benchmarks/bench_op_dispatch.py`` measures both); under
    ``torch.compile`` tracing the call goes through ``torch.ops.manylora.lora_shrink``,
    whose fake kernel Dynamo and Inductor see instead of the Triton wrapper.

    Args:
        x: ``[T, in]`` activations (float32, bfloat16 or float16).
        lora_a_stacked: 1-3 tensors ``[max_loras, max_lora_rank, in]``, dtype of ``x``.
        mapping: the step's token → slot map, on ``x``'s device.

    Returns:
        float32 ``[T, S, max_lora_rank]``; zero for base rows and padded ranks. Without a
        LoRA row (``mapping.has_lora`` False) the zero buffer, no kernel launched.

    Raises:
        ValueError: as ``lora_shrink_op``.
    """
    if not mapping.has_lora:
        return torch.zeros(x.shape[0], len(lora_a_stacked), lora_a_stacked[0].shape[1],
                           dtype=torch.float32, device=x.device)
    if mapping.schedule == "tiled":
        op = (torch.ops.manylora.lora_shrink_tiled if torch.compiler.is_compiling()
              else lora_shrink_tiled)
        return op(x, list(lora_a_stacked), _slice_ranks(mapping, len(lora_a_stacked)),
                  *_row_tiles(mapping))
    op = torch.ops.manylora.lora_shrink if torch.compiler.is_compiling() else lora_shrink_op
    return op(x, list(lora_a_stacked), mapping.token_lora_indices, mapping.slot_ranks,
              mapping.sorted_rows, mapping.active_slots, mapping.seg_start, mapping.seg_len,
              mapping.max_seg_len, mapping.schedule)


def lora_expand_triton(y: torch.Tensor, buffer: torch.Tensor,
                       lora_b_stacked: Sequence[torch.Tensor], mapping: LoRAMapping,
                       output_slices: Sequence[tuple[int, int]],
                       dora_scale_stacked: Sequence[torch.Tensor] | None = None,
                       dora_shift_stacked: Sequence[torch.Tensor] | None = None) -> None:
    """``y[t, off_s : off_s + out_s] += buffer[t, s] @ B_s[slot[t]]^T`` for every slice, in
    place, in one launch of Punica's SGMV or BGMV expand (``mapping.schedule``):
    ``lora_expand_op`` with the mapping's fields, called directly when eager and through
    ``torch.ops.manylora.lora_expand`` under ``torch.compile`` (see ``lora_shrink_triton``).

    With ``dora_scale_stacked``, rows whose slot is flagged in ``mapping.slot_dora`` get
    ``y[t, cols] = (y[t, cols] + delta) * scale_s[slot] (+ shift_s[slot])`` instead (float32,
    rounded once); the flag is read by the kernels, so the launch is the same whichever slots
    are DoRA (CUDA-graph safe).

    Args:
        y: ``[T, out_total]``, updated in place.
        buffer: float32 ``[T, S, max_lora_rank]`` from ``lora_shrink``.
        lora_b_stacked: 1-3 tensors ``[max_loras, out_s, max_lora_rank]``, dtype of ``y``.
        mapping: the step's token → slot map, on ``y``'s device.
        output_slices: ``S`` pairs ``(offset, out_s)``; ``out_s`` must be B_s's width.
        dora_scale_stacked: None, or ``S`` float32 ``[max_loras, out_s]`` DoRA scales.
        dora_shift_stacked: None, or ``S`` float32 ``[max_loras, out_s]`` DoRA shifts
            (only with scales).

    Raises:
        ValueError: ``output_slices`` and ``lora_b_stacked`` disagree (count or widths), or
            as ``lora_expand_op``.
    """
    if len(output_slices) != len(lora_b_stacked):
        raise ValueError(
            f"{len(output_slices)} output slices for {len(lora_b_stacked)} B stacks")
    if any(n != b.shape[1] for (_, n), b in zip(output_slices, lora_b_stacked)):
        raise ValueError(f"output slices {list(output_slices)} do not match the B widths "
                         f"{[b.shape[1] for b in lora_b_stacked]}")
    if not mapping.has_lora:
        return
    dora = dora_scale_stacked is not None
    if mapping.schedule == "tiled" and dora_shift_stacked is None:
        num_slices = len(lora_b_stacked)
        op = (torch.ops.manylora.lora_expand_tiled if torch.compiler.is_compiling()
              else lora_expand_tiled)
        op(y, buffer, [b.transpose(1, 2).contiguous() for b in lora_b_stacked],
           _slice_ranks(mapping, num_slices), *_row_tiles(mapping),
           [offset for offset, _ in output_slices],
           mapping.slot_dora[:, None].repeat(1, num_slices) if dora else None,
           list(dora_scale_stacked) if dora else None)
        return
    op = torch.ops.manylora.lora_expand if torch.compiler.is_compiling() else lora_expand_op
    op(y, buffer, list(lora_b_stacked), mapping.token_lora_indices, mapping.slot_ranks,
       mapping.sorted_rows, mapping.active_slots, mapping.seg_start, mapping.seg_len,
       mapping.max_seg_len, "sgmv" if mapping.schedule == "tiled" else mapping.schedule,
       [offset for offset, _ in output_slices],
       mapping.slot_dora if dora else None, list(dora_scale_stacked) if dora else None,
       None if dora_shift_stacked is None else list(dora_shift_stacked))


def _row_tiles(mapping: LoRAMapping) -> tuple:
    """The tiled ops' mapping arguments: ``sorted_rows``, the tile arrays, ``block_m``."""
    return (mapping.sorted_rows, mapping.tile_slot, mapping.tile_start, mapping.tile_len,
            mapping.block_m)


def _slice_ranks(mapping: LoRAMapping, num_slices: int) -> torch.Tensor:
    """int32 ``[max_loras, num_slices]``: each slot's rank for every slice (until the rank
    table gives one per (slot, module))."""
    return mapping.slot_ranks[:, None].repeat(1, num_slices)
