"""Triton kernels for the tiled LoRA schedule: each adapter read once per row tile, not per row.

The decode counterpart of Punica's SGMV (Chen et al. 2023): the step's LoRA rows, grouped by
slot (``LoRAMapping.sorted_rows``), are cut on the host into tiles of at most ``BLOCK_M`` rows
of one slot (``lora.punica.lora_row_tiles``). A program owns one tile, so A's and B's tiles
are read once for up to ``BLOCK_M`` rows, and runs ``tl.dot`` on them (rows past the tile's
length are masked: no memory traffic, only idle tensor-core lanes). Unlike SGMV, whose grid
is ``max_loras x m_tiles(longest segment)``, the grid here is the tile count: exact in an
eager step, and in a CUDA-graph (padded) mapping a bound that depends only on the padded row
count, ``max_loras`` and ``BLOCK_M`` (``lora.punica.max_row_tiles``); programs of padding
tiles (slot -1) exit at once.

Semantics, for every slice ``s``, tile ``i`` with ``slot = tile_slot[i] >= 0``, its rows
``t in sorted_rows[tile_start[i] : tile_start[i] + tile_len[i]]`` and
``r = ranks[slot, s]`` (the rank table, ``lora.slot_table``)::

    shrink:  buffer[t, s, :r] = x[t] @ A_s[slot, :r]^T                    (float32)
    expand:  delta = buffer[t, s, :r] @ B_s[slot, :r]                     (B rank-major)
             y[t, cols_s] += delta                                        (plain)
             y[t, cols_s] = (y[t, cols_s] + delta) * scale_s[slot]
                            + (1 - scale_s[slot]) * bias_s                (dora[slot, s] = 1)

A program whose (slot, slice) has rank 0 (an untargeted module, an empty slot), or whose rank
tile starts past the rank, returns before it loads x, A, B, the buffer or y. Shrink splits
the reduction over ``in`` (split-K, float32 atomics into a zeroed buffer) so that a few tiles
still fill the GPU; expand tiles the output columns.

The wrappers are CUDA-graph safe (no host synchronisation; grids from tensor shapes and the
mapping's host ints; block sizes from shape heuristics, no autotuning) and run on any device
Triton runs on, including CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from manylora.lora.row_tiles import max_row_tiles
from manylora.ops.host_math import cdiv, next_power_of_2

MAX_SLICES = 3
#: Row-tile heights the tiled schedule uses. 16 is the smallest ``tl.dot`` M on tensor cores;
#: a shorter tile costs the same memory traffic (masked rows are not loaded).
TILE_BLOCK_MS = (16, 32, 64)
# Programs to aim for in one launch: ~8 per SM of an H100 (132 SMs) keep HBM busy.
_TARGET_PROGRAMS = 1024
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The mapping's views and the rank table's column views sit at offsets that move with the
# row count or the (layer, module): Triton would otherwise compile one kernel per alignment.
_TILE_PTRS = ["ranks_ptr", "sorted_rows_ptr", "tile_slot_ptr", "tile_start_ptr",
              "tile_len_ptr"]


@triton.jit
def _pick(s, v0, v1, v2):
    """The value of slice ``s`` (0, 1 or 2): a slice's pointer, width or column offset."""
    if s == 0:
        v = v0
    elif s == 1:
        v = v1
    else:
        v = v2
    return v


@triton.jit(do_not_specialize=_TILE_PTRS)
def _tiled_shrink_kernel(
        x_ptr, a0_ptr, a1_ptr, a2_ptr, out_ptr, ranks_ptr, rank_stride,
        sorted_rows_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr,
        K, K_PER_SPLIT, stride_xt, stride_xk, stride_ot, stride_os,
        R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr, DOT_FP32: tl.constexpr):
    """Grid ``(num_tiles * r_tiles, split_k, NUM_SLICES)``."""
    R_TILES: tl.constexpr = (R + BLOCK_R - 1) // BLOCK_R
    tile = tl.program_id(0) // R_TILES
    pid_r = tl.program_id(0) % R_TILES
    pid_k = tl.program_id(1)
    s = tl.program_id(2)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot * rank_stride + s)
    if pid_r * BLOCK_R >= rank:
        return
    a_ptr = _pick(s, a0_ptr, a1_ptr, a2_ptr)
    tile_len = tl.load(tile_len_ptr + tile)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < tile_len
    rows = tl.load(sorted_rows_ptr + tl.load(tile_start_ptr + tile) + offs_m, mask=m_mask,
                   other=0).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = pid_k * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk
    a_ptrs = a_ptr + slot.to(tl.int64) * (R * K) + offs_r[:, None] * K + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for _ in range(0, K_PER_SPLIT, BLOCK_K):
        k_mask = offs_k < K
        xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_FP32:
            xt, at = xt.to(tl.float32), at.to(tl.float32)
        acc += tl.dot(xt, tl.trans(at), input_precision="ieee")
        offs_k += BLOCK_K
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K

    out_ptrs = out_ptr + rows[:, None] * stride_ot + s * stride_os + offs_r[None, :]
    mask = m_mask[:, None] & r_mask[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out_ptrs, acc, mask=mask)


@triton.jit(do_not_specialize=[*_TILE_PTRS, "dora_ptr", "bias0_ptr", "bias1_ptr",
                               "bias2_ptr", "N_TILES"])
def _tiled_expand_kernel(
        buf_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, ranks_ptr, dora_ptr, rank_stride,
        sorted_rows_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr,
        sc0_ptr, sc1_ptr, sc2_ptr, bias0_ptr, bias1_ptr, bias2_ptr,
        N0, N1, N2, OFF0, OFF1, OFF2, N_TILES,
        stride_bt, stride_bs, stride_yt, stride_yn,
        R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr, DOT_FP32: tl.constexpr, HAS_DORA: tl.constexpr,
        HAS_BIAS: tl.constexpr):
    """Grid ``(num_tiles * n_tiles, NUM_SLICES)``. With ``HAS_DORA`` a (slot, slice) flagged
    in ``dora`` stores ``(y + delta) * scale (+ (1 - scale) * bias)``."""
    tile = tl.program_id(0) // N_TILES
    pid_n = tl.program_id(0) % N_TILES
    s = tl.program_id(1)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot * rank_stride + s)
    if rank == 0:
        return
    n_out = _pick(s, N0, N1, N2)
    if pid_n * BLOCK_N >= n_out:
        return
    b_ptr = _pick(s, b0_ptr, b1_ptr, b2_ptr)
    col0 = _pick(s, OFF0, OFF1, OFF2)
    tile_len = tl.load(tile_len_ptr + tile)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < tile_len
    rows = tl.load(sorted_rows_ptr + tl.load(tile_start_ptr + tile) + offs_m, mask=m_mask,
                   other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    offs_r = tl.arange(0, BLOCK_R)
    buf_ptrs = buf_ptr + rows[:, None] * stride_bt + s * stride_bs + offs_r[None, :]
    # B[slot] is [R, n_out], rank-major: each of the tile's rank rows is contiguous in n.
    b_ptrs = (b_ptr + slot.to(tl.int64) * R * n_out + offs_r[:, None].to(tl.int64) * n_out
              + offs_n[None, :])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r_mask = r0 + offs_r < rank
        vt = tl.load(buf_ptrs, mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        bt = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        vt = vt.to(bt.dtype)
        if DOT_FP32:
            vt, bt = vt.to(tl.float32), bt.to(tl.float32)
        acc += tl.dot(vt, bt, input_precision="ieee")
        buf_ptrs += BLOCK_R
        b_ptrs += BLOCK_R * n_out

    y_ptrs = y_ptr + rows[:, None] * stride_yt + (col0 + offs_n)[None, :] * stride_yn
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    out = y.to(tl.float32) + acc
    if HAS_DORA:
        if tl.load(dora_ptr + slot * rank_stride + s) != 0:
            sc_ptr = _pick(s, sc0_ptr, sc1_ptr, sc2_ptr)
            scale = tl.load(sc_ptr + slot.to(tl.int64) * n_out + offs_n, mask=n_mask, other=1.0)
            out = out * scale[None, :]
            if HAS_BIAS:
                bias_ptr = _pick(s, bias0_ptr, bias1_ptr, bias2_ptr)
                bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                out = out + ((1.0 - scale) * bias)[None, :]
    tl.store(y_ptrs, out.to(y.dtype), mask=mask)


# ---------------------------------------------------------------------------------------------
# launch heuristics (host ints only)


class TiledPlan(NamedTuple):
    """One launch of a tiled LoRA kernel, from host ints only.

    Attributes:
        grid: the launch grid.
        constexprs: the compile-time constants (with ``num_warps``): what selects a compiled
            specialization, with the dtypes and the run-time ints' divisibility.
        k_per_split: shrink only: the ``in`` columns each split-K program reduces.
        n_tiles: expand only: output tiles per row tile.
    """

    grid: tuple[int, ...]
    constexprs: dict
    k_per_split: int = 0
    n_tiles: int = 0


def _split_k(k: int, block_k: int, programs: int) -> tuple[int, int]:
    """``(split_k, k_per_split)``: enough splits of ``k`` that ``programs * split_k`` reaches
    ``_TARGET_PROGRAMS``, each split a whole number of ``block_k`` blocks."""
    k_blocks = cdiv(k, block_k)
    split = min(k_blocks, next_power_of_2(cdiv(_TARGET_PROGRAMS, max(programs, 1))))
    k_per_split = cdiv(k_blocks, split) * block_k
    return cdiv(k, k_per_split), k_per_split


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _block_r(max_rank: int) -> int:
    return max(16, min(next_power_of_2(max_rank), 64))


def tiled_shrink_plan(num_tiles: int, block_m: int, k: int, max_rank: int, num_slices: int,
                      element_size: int, dot_fp32: bool = False) -> TiledPlan:
    """The launch of ``lora_shrink_tiled`` over ``num_tiles`` row tiles of ``block_m`` rows,
    ``in = k``, A stacks ``[max_loras, max_rank, k]`` of ``element_size``-byte elements
    (``dot_fp32``: bfloat16 under the interpreter). Ranks in tiles of 16-64; a ``k`` step
    whose x and A tiles fit 32 KiB (16-bit) or 16 KiB (float32); split-K up to
    ``_TARGET_PROGRAMS`` programs (``ATOMIC`` when split).

    Raises:
        ValueError: ``block_m`` not in ``TILE_BLOCK_MS``.
    """
    if block_m not in TILE_BLOCK_MS:
        raise ValueError(f"tiled LoRA: BLOCK_M {block_m} is not one of {TILE_BLOCK_MS}")
    block_r = _block_r(max_rank)
    tile_bytes = 32768 if element_size == 2 else 16384
    block_k = max(16, min(256, _pow2_floor(tile_bytes // ((block_m + block_r) * element_size))))
    r_tiles = cdiv(max_rank, block_r)
    split, k_per_split = _split_k(k, block_k, num_tiles * r_tiles * num_slices)
    return TiledPlan((num_tiles * r_tiles, split, num_slices),
                     dict(R=max_rank, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
                          ATOMIC=split > 1, DOT_FP32=dot_fp32, num_warps=4), k_per_split)


def tiled_expand_plan(num_tiles: int, block_m: int, max_n: int, max_rank: int,
                      num_slices: int, has_dora: bool, has_bias: bool,
                      dot_fp32: bool = False) -> TiledPlan:
    """The launch of ``lora_expand_tiled`` over ``num_tiles`` row tiles of ``block_m`` rows
    into slices at most ``max_n`` wide: the widest output tile of 64..256 columns (128 for
    64-row tiles) that still gives ``_TARGET_PROGRAMS`` programs; the rank in tiles of
    16-64.

    Raises:
        ValueError: ``block_m`` not in ``TILE_BLOCK_MS``.
    """
    if block_m not in TILE_BLOCK_MS:
        raise ValueError(f"tiled LoRA: BLOCK_M {block_m} is not one of {TILE_BLOCK_MS}")
    programs = max(num_tiles, 1) * num_slices
    block_n = 256 if block_m <= 32 else 128
    while block_n > 64 and programs * cdiv(max_n, block_n) < _TARGET_PROGRAMS:
        block_n //= 2
    n_tiles = cdiv(max_n, block_n)
    return TiledPlan((num_tiles * n_tiles, num_slices),
                     dict(R=max_rank, BLOCK_M=block_m, BLOCK_N=block_n,
                          BLOCK_R=_block_r(max_rank), DOT_FP32=dot_fp32, HAS_DORA=has_dora,
                          HAS_BIAS=has_bias, num_warps=4), n_tiles=n_tiles)


def tiled_row_cases(max_rows: int, max_loras: int) -> Iterator[tuple[int, int]]:
    """``(num_tiles, block_m)`` covering every distinct ``tiled_shrink_plan`` /
    ``tiled_expand_plan`` launch of steps of 1..``max_rows`` rows over ``max_loras`` slots:
    the plans see the step only through the tile count (at most ``max_row_tiles``) and
    ``block_m``, and stop changing once the tiles reach ``_TARGET_PROGRAMS``."""
    for block_m in TILE_BLOCK_MS:
        most = max_row_tiles(max_rows, max_loras, block_m)
        for num_tiles in range(1, min(most, _TARGET_PROGRAMS) + 1):
            yield num_tiles, block_m


def _interpreted_bf16(t: torch.Tensor) -> bool:
    """Whether ``tl.dot`` must take float32 operands: Triton's interpreter multiplies
    bfloat16 tiles as their raw bit patterns (upcasting is exact)."""
    return t.dtype == torch.bfloat16 and t.device.type != "cuda"


class RowTiles(NamedTuple):
    """The tile view of a step's LoRA rows (``LoRAMapping``'s tile fields).

    Attributes:
        sorted_rows: int32 ``[T]``, LoRA rows grouped by slot.
        tile_slot: int32 ``[num_tiles]``, each tile's slot, -1 for padding tiles.
        tile_start: int32 ``[num_tiles]``, the tile's first index into ``sorted_rows``.
        tile_len: int32 ``[num_tiles]``, its rows (1..``block_m``; 0 for padding).
        block_m: host int, the most rows of a tile (one of ``TILE_BLOCK_MS``).
    """

    sorted_rows: torch.Tensor
    tile_slot: torch.Tensor
    tile_start: torch.Tensor
    tile_len: torch.Tensor
    block_m: int


def _check_table(name: str, table: torch.Tensor, max_loras: int, num_slices: int,
                 device: torch.device) -> None:
    """Raise ValueError unless ``table`` is an int32 ``[max_loras, >= num_slices]`` view on
    ``device`` with unit column stride (a ``SlotTable`` column view)."""
    if (table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != max_loras
            or table.shape[1] < num_slices or table.device != device
            or (table.shape[1] > 1 and table.stride(1) != 1)):
        raise ValueError(f"{name}: expected int32 [{max_loras}, >={num_slices}] with unit "
                         f"column stride on {device}, got {tuple(table.shape)} "
                         f"{table.dtype} strides {table.stride()} on {table.device}")


def _check_rows(num_rows: int, tiles: RowTiles) -> None:
    if tiles.sorted_rows.shape[0] != num_rows:
        raise ValueError(f"the mapping has {tiles.sorted_rows.shape[0]} rows, the activations "
                         f"{num_rows}")


def _check_stacks(name: str, stacks: Sequence[torch.Tensor], dtype: torch.dtype,
                  device: torch.device) -> None:
    if not 1 <= len(stacks) <= MAX_SLICES:
        raise ValueError(f"{name}: {len(stacks)} slices, the kernels take 1 to {MAX_SLICES}")
    for t in stacks:
        if t.dim() != 3 or t.dtype != dtype or t.device != device:
            raise ValueError(f"{name}: expected 3-d {dtype} tensors on {device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")


def lora_shrink_tiled(x: torch.Tensor, lora_a_stacked: Sequence[torch.Tensor],
                      ranks: torch.Tensor, tiles: RowTiles) -> torch.Tensor:
    """``buffer[t, s, :r] = x[t] @ A_s[slot, :r]^T`` over the step's row tiles, all slices
    in one launch (module docstring).

    Args:
        x: ``[T, in]``, float32, bfloat16 or float16.
        lora_a_stacked: 1-3 contiguous ``[max_loras, max_lora_rank, in]`` tensors, dtype of
            ``x``; rows past a (slot, slice)'s rank are never read.
        ranks: int32 ``[max_loras, >= S]`` (unit column stride), ``ranks[slot, s]`` the rank
            of slice ``s`` in ``slot``: the projection's columns of the rank table.
        tiles: the step's ``RowTiles``.

    Returns:
        float32 ``[T, S, max_lora_rank]``: the products for rows of a tile, zero for other
        rows and for columns at or past the rank. With split-K the float32 summation order
        varies between runs.

    Raises:
        ValueError: 0 or more than 3 slices, slices of another dtype/device/shape, an
            unsupported dtype, a malformed rank table, tiles of another row count, or a
            ``block_m`` the kernels do not take.
    """
    if x.dtype not in _DTYPES or x.dim() != 2:
        raise ValueError(f"lora_shrink: x must be 2-d float32/bf16/fp16, got {x.dtype}")
    _check_stacks("lora_shrink", lora_a_stacked, x.dtype, x.device)
    stacks = [a.contiguous() for a in lora_a_stacked]
    max_loras, max_rank, k = stacks[0].shape
    if any(a.shape != stacks[0].shape for a in stacks) or k != x.shape[1]:
        raise ValueError(f"lora_shrink: A slices {[tuple(a.shape) for a in stacks]} do not all "
                         f"match [max_loras, max_lora_rank, {x.shape[1]}]")
    _check_table("lora_shrink ranks", ranks, max_loras, len(stacks), x.device)
    num_rows, num_slices = x.shape[0], len(stacks)
    _check_rows(num_rows, tiles)
    out = torch.zeros(num_rows, num_slices, max_rank, dtype=torch.float32, device=x.device)
    num_tiles = tiles.tile_slot.shape[0]
    plan = tiled_shrink_plan(num_tiles, tiles.block_m, k, max_rank, num_slices,
                             x.element_size(), _interpreted_bf16(x))
    if num_rows == 0 or max_rank == 0 or num_tiles == 0:
        return out
    a0, a1, a2 = (stacks + [stacks[0]] * MAX_SLICES)[:MAX_SLICES]
    _tiled_shrink_kernel[plan.grid](
        x, a0, a1, a2, out, ranks, ranks.stride(0), tiles.sorted_rows, tiles.tile_slot,
        tiles.tile_start, tiles.tile_len, k, plan.k_per_split, x.stride(0), x.stride(1),
        out.stride(0), out.stride(1), **plan.constexprs)
    return out


def lora_expand_tiled(y: torch.Tensor, buffer: torch.Tensor,
                      lora_b_stacked: Sequence[torch.Tensor], ranks: torch.Tensor,
                      tiles: RowTiles, slice_offsets: Sequence[int],
                      dora: torch.Tensor | None = None,
                      dora_scale_stacked: Sequence[torch.Tensor] | None = None,
                      dora_bias: Sequence[torch.Tensor] | None = None) -> None:
    """``y[t, off_s : off_s + out_s] += buffer[t, s, :r] @ B_s[slot, :r]`` in place over the
    step's row tiles, all slices in one launch, with DoRA's rescaling fused in (module
    docstring): a (slot, slice) with ``dora[slot, s] == 1`` (only when
    ``dora_scale_stacked`` is given) stores ``(y + delta) * scale (+ (1 - scale) * bias)``
    in float32, rounded once.

    Args:
        y: ``[T, out_total]``, float32, bfloat16 or float16; rows of no tile and columns of
            no slice are left untouched, as are the rows of a (slot, slice) of rank 0.
        buffer: float32 ``[T, S, max_lora_rank]`` from ``lora_shrink_tiled``.
        lora_b_stacked: 1-3 contiguous rank-major ``[max_loras, max_lora_rank, out_s]``
            tensors, dtype of ``y``; rank rows past a (slot, slice)'s rank are never read.
        ranks: int32 ``[max_loras, >= S]``, as ``lora_shrink_tiled``'s.
        tiles: the step's ``RowTiles``.
        slice_offsets: ``S`` column offsets into ``y``; the slices must not overlap.
        dora: int32 ``[max_loras, >= S]`` with ``ranks``'s strides, the rank table's DoRA
            flags; needed with DoRA scales.
        dora_scale_stacked: None, or ``S`` float32 ``[max_loras, out_s]`` DoRA scales
            ``m / ||W + BA||`` (read only for flagged (slot, slice)s).
        dora_bias: None (no bias), or ``S`` tensors ``[out_s]``, each slice's part of the
            projection's bias (any float dtype), which ``y`` already includes.

    The buffer tile is rounded to ``y``'s dtype before its ``tl.dot`` (as Punica and vLLM
    do); the sum with ``y`` is float32, rounded once.

    Raises:
        ValueError: 0 or more than 3 slices, slices of another dtype/device/rank, offsets
            that do not fit ``y`` or overlap, a buffer of the wrong shape, tiles of another
            row count, a malformed rank or
            DoRA table, DoRA stacks of another shape, a bias without scales, or a
            ``block_m`` the kernels do not take.
    """
    if y.dtype not in _DTYPES or y.dim() != 2:
        raise ValueError(f"lora_expand: y must be 2-d float32/bf16/fp16, got {y.dtype}")
    _check_stacks("lora_expand", lora_b_stacked, y.dtype, y.device)
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
    _check_table("lora_expand ranks", ranks, max_loras, num_slices, y.device)
    _check_rows(num_rows, tiles)
    has_dora = dora_scale_stacked is not None
    if has_dora:
        _check_table("lora_expand dora", dora, max_loras, num_slices, y.device)
        if dora.stride() != ranks.stride():
            raise ValueError(f"lora_expand: the DoRA flags' strides {dora.stride()} differ "
                             f"from the ranks' {ranks.stride()}")
        want = [(max_loras, n) for n in sizes]
        if ([tuple(t.shape) for t in dora_scale_stacked] != want
                or any(t.dtype != torch.float32 or t.device != y.device
                       for t in dora_scale_stacked)):
            raise ValueError(f"lora_expand: DoRA scales "
                             f"{[tuple(t.shape) for t in dora_scale_stacked]}, expected "
                             f"float32 {want} on {y.device}")
    elif dora_bias is not None:
        raise ValueError("lora_expand: a DoRA bias was given without DoRA scales")
    if dora_bias is not None and ([tuple(t.shape) for t in dora_bias] != [(n,) for n in sizes]
                                  or any(t.device != y.device for t in dora_bias)):
        raise ValueError(f"lora_expand: DoRA bias {[tuple(t.shape) for t in dora_bias]}, "
                         f"expected {[(n,) for n in sizes]} on {y.device}")
    num_tiles = tiles.tile_slot.shape[0]
    plan = tiled_expand_plan(num_tiles, tiles.block_m, max(sizes), max_rank, num_slices,
                             has_dora, dora_bias is not None, _interpreted_bf16(y))
    if num_rows == 0 or max_rank == 0 or num_tiles == 0:
        return
    b0, b1, b2 = (stacks + [stacks[0]] * MAX_SLICES)[:MAX_SLICES]
    n0, n1, n2 = (sizes + [0] * MAX_SLICES)[:MAX_SLICES]
    o0, o1, o2 = (list(slice_offsets) + [0] * MAX_SLICES)[:MAX_SLICES]
    scales = [t.contiguous() for t in dora_scale_stacked] if has_dora else [y]
    biases = [t.contiguous() for t in dora_bias] if dora_bias is not None else [y]
    sc0, sc1, sc2 = (scales + [scales[0]] * MAX_SLICES)[:MAX_SLICES]
    bi0, bi1, bi2 = (biases + [biases[0]] * MAX_SLICES)[:MAX_SLICES]
    _tiled_expand_kernel[plan.grid](
        buffer, b0, b1, b2, y, ranks, dora if has_dora else ranks, ranks.stride(0),
        tiles.sorted_rows, tiles.tile_slot, tiles.tile_start, tiles.tile_len,
        sc0, sc1, sc2, bi0, bi1, bi2, n0, n1, n2, o0, o1, o2, plan.n_tiles,
        buffer.stride(0), buffer.stride(1), y.stride(0), y.stride(1), **plan.constexprs)
