"""Triton kernels for batched multi-LoRA shrink/expand: Punica's SGMV and BGMV.

Follows Punica (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving") and vLLM's punica
Triton kernels: one launch applies every adapter of the step to every row, for all slices of
a packed projection (q/k/v, gate/up) at once. Two schedules over the same
:class:`~manylora.lora.punica.LoRAMapping`:

* ``"sgmv"`` (segmented gather matrix-vector, for prefill and popular adapters): a program
  owns a tile of ``BLOCK_M`` rows of one slot, gathered through ``sorted_rows``, and runs
  ``tl.dot`` on it; the grid is sized from the host int ``max_seg_len`` and ``max_loras``,
  programs past their segment's length (or of an unused segment) exit at once.
* ``"bgmv"`` (batched gather matrix-vector, for decode with many distinct adapters): one
  program per token row (× output tile × slice) reads its slot from ``token_lora_indices``
  and does a broadcast-multiply + ``tl.sum``; base rows (slot -1) exit at once.

Both read each slot's true rank from ``slot_ranks`` in the kernel: a rank-8 adapter in a
rank-64 slot buffer does rank-8 work. Shrink splits the reduction over ``in`` (split-K, fp32
atomics into a zeroed buffer) so that small batches still fill the GPU; expand tiles the
output columns and stops its reduction at the rank.

Expand also fuses DoRA (Liu et al. 2024): launched with per-slot scales (and shifts), a
program whose slot is flagged in ``slot_dora`` stores ``(y + delta) * scale (+ shift)`` in
float32, rounded once, and only such programs load the scale/shift tiles. The flag is data,
read per program, so one launch (one captured graph) serves any mix of DoRA and plain slots;
``HAS_DORA`` / ``HAS_SHIFT`` are constexprs, so a launch without DoRA arguments compiles to
the plain kernel.

The wrappers are CUDA-graph safe: no host synchronisation, grids only from tensor shapes and
the mapping's host ints, block sizes from shape heuristics (no autotuning). Both ops are
registered directly with the dispatcher (``torch.ops.manylora.lora_shrink`` / ``lora_expand``,
a ``torch.library.Library`` definition with fake kernels, for ``torch.compile``); eager
callers skip the dispatcher (see ``lora_shrink_triton``). They run on any device Triton runs
on, including CPU tensors under ``TRITON_INTERPRET=1``.

The slot buffers are expected as ``LoRASlots`` lays them out: contiguous (others are copied
first), and zero (at least finite) past each slot's rank. Shrink never reads A past the
rank; expand reads B up to the rank rounded up to ``gcd(max_lora_rank, 8)`` so that its
loads along the rank stay vectorized.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from manylora.lora.punica import LoRAMapping
from manylora.ops.host_math import cdiv, next_power_of_2

MAX_SLICES = 3
# Programs to aim for in one launch: ~8 per SM of an H100 (132 SMs) keep HBM busy.
_TARGET_PROGRAMS = 1024
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# The per-step LoRAMapping tensors are views at offsets of one buffer that move with the row
# count, and N_TILES varies with the batch: Triton would otherwise compile one kernel per
# pointer alignment (16 bytes or not) and per int that happens to be 1 or a multiple of 16.
_SEGMENT_PTRS = ["slot_ranks_ptr", "sorted_rows_ptr", "active_slots_ptr", "seg_start_ptr",
                 "seg_len_ptr"]
_GATHER_PTRS = ["token_lora_ptr", "slot_ranks_ptr"]

# ---------------------------------------------------------------------------------------------
# kernels


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


@triton.jit
def _dora_row(p0, p1, p2, s, slot, n_out, offs_n, n_mask, other: tl.constexpr):
    """Slice ``s``'s float32 ``[BLOCK_N]`` tile of a ``[max_loras, n_out]`` DoRA stack (the
    scales or the shifts) at ``slot``, columns ``offs_n``."""
    p = _pick(s, p0, p1, p2)
    return tl.load(p + slot.to(tl.int64) * n_out + offs_n, mask=n_mask, other=other)


@triton.jit(do_not_specialize=_SEGMENT_PTRS)
def _sgmv_shrink_kernel(
        x_ptr, a0_ptr, a1_ptr, a2_ptr, out_ptr,
        slot_ranks_ptr, sorted_rows_ptr, active_slots_ptr, seg_start_ptr, seg_len_ptr,
        K, K_PER_SPLIT, stride_xt, stride_xk, stride_ot, stride_os,
        R: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
        DOT_FP32: tl.constexpr):
    """Grid ``(m_tiles * r_tiles, split_k, max_loras * NUM_SLICES)``."""
    R_TILES: tl.constexpr = (R + BLOCK_R - 1) // BLOCK_R
    pid_m = tl.program_id(0) // R_TILES
    pid_r = tl.program_id(0) % R_TILES
    pid_k = tl.program_id(1)
    seg = tl.program_id(2) // NUM_SLICES
    s = tl.program_id(2) % NUM_SLICES
    slot = tl.load(active_slots_ptr + seg)
    if slot < 0:
        return
    seg_len = tl.load(seg_len_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    rank = tl.load(slot_ranks_ptr + slot)
    if pid_r * BLOCK_R >= rank:
        return
    a_ptr = _pick(s, a0_ptr, a1_ptr, a2_ptr)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    rows = tl.load(sorted_rows_ptr + tl.load(seg_start_ptr + seg) + offs_m, mask=m_mask,
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


@triton.jit(do_not_specialize=_GATHER_PTRS)
def _bgmv_shrink_kernel(
        x_ptr, a0_ptr, a1_ptr, a2_ptr, out_ptr, token_lora_ptr, slot_ranks_ptr,
        K, K_PER_SPLIT, stride_xt, stride_xk, stride_ot, stride_os,
        R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr):
    """Grid ``(T * r_tiles, split_k, NUM_SLICES)``."""
    R_TILES: tl.constexpr = (R + BLOCK_R - 1) // BLOCK_R
    t = tl.program_id(0) // R_TILES
    pid_r = tl.program_id(0) % R_TILES
    pid_k = tl.program_id(1)
    s = tl.program_id(2)
    slot = tl.load(token_lora_ptr + t)
    if slot < 0:
        return
    rank = tl.load(slot_ranks_ptr + slot)
    if pid_r * BLOCK_R >= rank:
        return
    a_ptr = _pick(s, a0_ptr, a1_ptr, a2_ptr)

    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = pid_k * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + t.to(tl.int64) * stride_xt + offs_k * stride_xk
    a_ptrs = a_ptr + slot.to(tl.int64) * (R * K) + offs_r[:, None] * K + offs_k[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for _ in range(0, K_PER_SPLIT, BLOCK_K):
        k_mask = offs_k < K
        xv = tl.load(x_ptrs, mask=k_mask, other=0.0)
        at = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += at.to(tl.float32) * xv.to(tl.float32)[None, :]
        offs_k += BLOCK_K
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K

    out_ptrs = out_ptr + t.to(tl.int64) * stride_ot + s * stride_os + offs_r
    if ATOMIC:
        tl.atomic_add(out_ptrs, tl.sum(acc, axis=1), mask=r_mask, sem="relaxed")
    else:
        tl.store(out_ptrs, tl.sum(acc, axis=1), mask=r_mask)


@triton.jit(do_not_specialize=[*_SEGMENT_PTRS, "slot_dora_ptr", "N_TILES"])
def _sgmv_expand_kernel(
        buf_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr,
        slot_ranks_ptr, sorted_rows_ptr, active_slots_ptr, seg_start_ptr, seg_len_ptr,
        slot_dora_ptr, sc0_ptr, sc1_ptr, sc2_ptr, sh0_ptr, sh1_ptr, sh2_ptr,
        N0, N1, N2, OFF0, OFF1, OFF2, N_TILES,
        stride_bt, stride_bs, stride_yt, stride_yn,
        R: tl.constexpr, RANK_ALIGN: tl.constexpr, NUM_SLICES: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        DOT_FP32: tl.constexpr, HAS_DORA: tl.constexpr, HAS_SHIFT: tl.constexpr):
    """Grid ``(m_tiles * n_tiles, max_loras * NUM_SLICES)``. With ``HAS_DORA`` a program of
    a slot whose ``slot_dora`` flag is set stores ``(y + delta) * scale (+ shift)``."""
    pid_m = tl.program_id(0) // N_TILES
    pid_n = tl.program_id(0) % N_TILES
    seg = tl.program_id(1) // NUM_SLICES
    s = tl.program_id(1) % NUM_SLICES
    slot = tl.load(active_slots_ptr + seg)
    if slot < 0:
        return
    seg_len = tl.load(seg_len_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    b_ptr = _pick(s, b0_ptr, b1_ptr, b2_ptr)
    n_out = _pick(s, N0, N1, N2)
    col0 = _pick(s, OFF0, OFF1, OFF2)
    if pid_n * BLOCK_N >= n_out:
        return
    rank = tl.load(slot_ranks_ptr + slot)
    # B is read up to the rank rounded up to RANK_ALIGN (zero padding): loads stay vectorized.
    rank_bound = (rank + RANK_ALIGN - 1) // RANK_ALIGN * RANK_ALIGN

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    rows = tl.load(sorted_rows_ptr + tl.load(seg_start_ptr + seg) + offs_m, mask=m_mask,
                   other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    offs_r = tl.arange(0, BLOCK_R)
    buf_ptrs = buf_ptr + rows[:, None] * stride_bt + s * stride_bs + offs_r[None, :]
    # B[slot] is [n_out, R], rank fastest: the [BLOCK_R, BLOCK_N] tile is B^T.
    b_ptrs = (b_ptr + slot.to(tl.int64) * n_out * R + offs_n[None, :].to(tl.int64) * R
              + offs_r[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        vt = tl.load(buf_ptrs, mask=m_mask[:, None] & (r0 + offs_r < rank)[None, :], other=0.0)
        bt = tl.load(b_ptrs, mask=(r0 + offs_r < rank_bound)[:, None] & n_mask[None, :],
                     other=0.0)
        vt = vt.to(bt.dtype)
        if DOT_FP32:
            vt, bt = vt.to(tl.float32), bt.to(tl.float32)
        acc += tl.dot(vt, bt, input_precision="ieee")
        buf_ptrs += BLOCK_R
        b_ptrs += BLOCK_R

    y_ptrs = y_ptr + rows[:, None] * stride_yt + (col0 + offs_n)[None, :] * stride_yn
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    out = y.to(tl.float32) + acc
    if HAS_DORA:
        if tl.load(slot_dora_ptr + slot) != 0:
            out = out * _dora_row(sc0_ptr, sc1_ptr, sc2_ptr, s, slot, n_out, offs_n, n_mask,
                                  1.0)[None, :]
            if HAS_SHIFT:
                out = out + _dora_row(sh0_ptr, sh1_ptr, sh2_ptr, s, slot, n_out, offs_n,
                                      n_mask, 0.0)[None, :]
    tl.store(y_ptrs, out.to(y.dtype), mask=mask)


@triton.jit(do_not_specialize=[*_GATHER_PTRS, "slot_dora_ptr"])
def _bgmv_expand_kernel(
        buf_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, token_lora_ptr, slot_ranks_ptr,
        slot_dora_ptr, sc0_ptr, sc1_ptr, sc2_ptr, sh0_ptr, sh1_ptr, sh2_ptr,
        N0, N1, N2, OFF0, OFF1, OFF2,
        stride_bt, stride_bs, stride_yt, stride_yn,
        R: tl.constexpr, RANK_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr, HAS_DORA: tl.constexpr, HAS_SHIFT: tl.constexpr):
    """Grid ``(T, n_tiles, NUM_SLICES)``. With ``HAS_DORA`` a row whose slot has its
    ``slot_dora`` flag set stores ``(y + delta) * scale (+ shift)``."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = tl.program_id(2)
    slot = tl.load(token_lora_ptr + t)
    if slot < 0:
        return
    b_ptr = _pick(s, b0_ptr, b1_ptr, b2_ptr)
    n_out = _pick(s, N0, N1, N2)
    col0 = _pick(s, OFF0, OFF1, OFF2)
    if pid_n * BLOCK_N >= n_out:
        return
    rank = tl.load(slot_ranks_ptr + slot)
    # B is read up to the rank rounded up to RANK_ALIGN (zero padding): loads stay vectorized.
    rank_bound = (rank + RANK_ALIGN - 1) // RANK_ALIGN * RANK_ALIGN

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    offs_r = tl.arange(0, BLOCK_R)
    buf_ptrs = buf_ptr + t.to(tl.int64) * stride_bt + s * stride_bs + offs_r
    b_ptrs = (b_ptr + slot.to(tl.int64) * n_out * R + offs_n[:, None].to(tl.int64) * R
              + offs_r[None, :])
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        v = tl.load(buf_ptrs, mask=r0 + offs_r < rank, other=0.0)
        bt = tl.load(b_ptrs, mask=n_mask[:, None] & (r0 + offs_r < rank_bound)[None, :],
                     other=0.0)
        acc += bt.to(tl.float32) * v[None, :]
        buf_ptrs += BLOCK_R
        b_ptrs += BLOCK_R

    y_ptrs = y_ptr + t.to(tl.int64) * stride_yt + (col0 + offs_n) * stride_yn
    y = tl.load(y_ptrs, mask=n_mask, other=0.0)
    out = y.to(tl.float32) + tl.sum(acc, axis=1)
    if HAS_DORA:
        if tl.load(slot_dora_ptr + slot) != 0:
            out = out * _dora_row(sc0_ptr, sc1_ptr, sc2_ptr, s, slot, n_out, offs_n, n_mask,
                                  1.0)
            if HAS_SHIFT:
                out = out + _dora_row(sh0_ptr, sh1_ptr, sh2_ptr, s, slot, n_out, offs_n,
                                      n_mask, 0.0)
    tl.store(y_ptrs, out.to(y.dtype), mask=n_mask)


# ---------------------------------------------------------------------------------------------
# launch heuristics (host ints only)


def _split_k(k: int, block_k: int, programs: int) -> tuple[int, int]:
    """``(split_k, k_per_split)``: enough splits of ``k`` that ``programs * split_k`` reaches
    the target, each split a whole number of ``block_k`` blocks."""
    k_blocks = cdiv(k, block_k)
    split = min(k_blocks, next_power_of_2(cdiv(_TARGET_PROGRAMS, programs)))
    k_per_split = cdiv(k_blocks, split) * block_k
    return cdiv(k, k_per_split), k_per_split


def _block_n(programs: int, max_n: int, largest: int) -> int:
    """The widest output tile (64..``largest``) that still gives the target program count."""
    block_n = largest
    while block_n > 64 and programs * cdiv(max_n, block_n) < _TARGET_PROGRAMS:
        block_n //= 2
    return block_n


def _interpreted_bf16(t: torch.Tensor) -> bool:
    """Whether ``tl.dot`` must take float32 operands: Triton's interpreter (CPU tensors)
    multiplies bfloat16 tiles as their raw 16-bit patterns. Upcasting is exact (a bf16 x bf16
    product is exact in float32, as in the tensor-core dot with float32 accumulation)."""
    return t.dtype == torch.bfloat16 and t.device.type != "cuda"


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _block_m(max_seg_len: int) -> int:
    return 16 if max_seg_len <= 16 else (32 if max_seg_len <= 32 else 64)


class LaunchPlan(NamedTuple):
    """One launch of a LoRA kernel, from host ints only.

    Attributes:
        kernel: the ``@triton.jit`` kernel's name in this module.
        grid: the launch grid (up to 3 ints).
        constexprs: the compile-time constants (with ``num_warps``): what selects a compiled
            specialization, with the dtypes and the run-time ints' divisibility.
        k_per_split: shrink only: the ``in`` columns each split-K program reduces.
        n_tiles: SGMV expand only: output tiles per row tile (the grid's first axis is
            ``m_tiles * n_tiles``).
    """

    kernel: str
    grid: tuple[int, ...]
    constexprs: dict
    k_per_split: int = 0
    n_tiles: int = 0


def shrink_plan(schedule: str, num_rows: int, max_seg_len: int, max_loras: int, k: int,
                max_rank: int, num_slices: int, element_size: int,
                dot_fp32: bool = False) -> LaunchPlan:
    """The launch of ``lora_shrink_op`` for ``num_rows`` rows (``max_seg_len`` the longest
    SGMV segment) of ``in = k`` over ``num_slices`` A stacks ``[max_loras, max_rank, k]`` of
    ``element_size``-byte elements (``dot_fp32``: bfloat16 under the interpreter). Block
    sizes: SGMV tiles of 16/32/64 rows by ``max_seg_len``, ranks in tiles of 16-64 (BGMV:
    up to 32), a ``k`` step whose x and A tiles fit 32 KiB (16-bit) or 16 KiB (float32);
    split-K up to ``_TARGET_PROGRAMS`` programs (``ATOMIC`` when split)."""
    if schedule == "sgmv":
        block_m = _block_m(max_seg_len)
        block_r = max(16, min(next_power_of_2(max_rank), 64))
        # x and A tiles of one k step within 32 KiB (16-bit) or 16 KiB (fp32, FMA dot); the
        # pipeline keeps a few of them in shared memory.
        tile_bytes = 32768 if element_size == 2 else 16384
        block_k = max(16, min(256, _pow2_floor(tile_bytes // ((block_m + block_r) * element_size))))
        m_tiles, r_tiles = cdiv(max_seg_len, block_m), cdiv(max_rank, block_r)
        split, k_per_split = _split_k(
            k, block_k, cdiv(num_rows, block_m) * r_tiles * num_slices)
        return LaunchPlan("_sgmv_shrink_kernel", (m_tiles * r_tiles, split, max_loras * num_slices),
                          dict(R=max_rank, NUM_SLICES=num_slices, BLOCK_M=block_m,
                               BLOCK_R=block_r, BLOCK_K=block_k, ATOMIC=split > 1,
                               DOT_FP32=dot_fp32, num_warps=4), k_per_split)
    block_r = min(next_power_of_2(max_rank), 32)
    block_k = max(32, min(512, 4096 // block_r))
    r_tiles = cdiv(max_rank, block_r)
    split, k_per_split = _split_k(k, block_k, num_rows * r_tiles * num_slices)
    return LaunchPlan("_bgmv_shrink_kernel", (num_rows * r_tiles, split, num_slices),
                      dict(R=max_rank, BLOCK_R=block_r, BLOCK_K=block_k, ATOMIC=split > 1,
                           num_warps=4), k_per_split)


def expand_plan(schedule: str, num_rows: int, max_seg_len: int, max_loras: int, max_n: int,
                max_rank: int, num_slices: int, has_dora: bool, has_shift: bool,
                dot_fp32: bool = False) -> LaunchPlan:
    """The launch of ``lora_expand_op`` for ``num_rows`` rows (``max_seg_len`` the longest
    SGMV segment) into slices at most ``max_n`` wide from B stacks ``[max_loras, out_s,
    max_rank]``. Output tiles: the widest of 64..256 columns that still gives
    ``_TARGET_PROGRAMS`` programs; SGMV row tiles as ``shrink_plan``'s; the rank in one tile
    of 16-64 (BGMV: up to 32) columns."""
    flags = dict(R=max_rank, RANK_ALIGN=math.gcd(max_rank, 8), HAS_DORA=has_dora,
                 HAS_SHIFT=has_shift, num_warps=4)
    if schedule == "sgmv":
        block_m = _block_m(max_seg_len)
        block_n = _block_n(cdiv(num_rows, block_m) * num_slices, max_n,
                           256 if block_m <= 32 else 128)
        m_tiles, n_tiles = cdiv(max_seg_len, block_m), cdiv(max_n, block_n)
        return LaunchPlan("_sgmv_expand_kernel", (m_tiles * n_tiles, max_loras * num_slices),
                          dict(flags, NUM_SLICES=num_slices, BLOCK_M=block_m, BLOCK_N=block_n,
                               BLOCK_R=max(16, min(next_power_of_2(max_rank), 64)),
                               DOT_FP32=dot_fp32), n_tiles=n_tiles)
    block_r = min(next_power_of_2(max_rank), 32)
    block_n = _block_n(num_rows * num_slices, max_n, min(256, max(64, 4096 // block_r)))
    return LaunchPlan("_bgmv_expand_kernel", (num_rows, cdiv(max_n, block_n), num_slices),
                      dict(flags, BLOCK_N=block_n, BLOCK_R=block_r))


def lora_row_cases(max_rows: int) -> Iterator[tuple[str, int, int]]:
    """``(schedule, num_rows, max_seg_len)`` covering every distinct ``shrink_plan`` /
    ``expand_plan`` launch (kernel and constexprs) of steps of 1..``max_rows`` rows, for any
    projection shape: the plans see the row count only through BGMV's ``num_rows`` and
    SGMV's row-tile count ``cdiv(num_rows, BLOCK_M)`` (with ``BLOCK_M`` from the longest
    segment), and stop changing once those reach ``_TARGET_PROGRAMS``. A padded CUDA-graph
    mapping (``max_seg_len`` = rows) is one of these cases too."""
    for n in range(1, min(max_rows, _TARGET_PROGRAMS) + 1):
        yield "bgmv", n, n
    for block_m, shortest in ((16, 1), (32, 17), (64, 33)):     # the classes of _block_m
        for tiles in range(1, min(cdiv(max_rows, block_m), _TARGET_PROGRAMS) + 1):
            n = min(tiles * block_m, max_rows)
            if n >= shortest:
                yield "sgmv", n, min(n, block_m)


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
                       x.element_size(), _interpreted_bf16(x))
    strides = (x.stride(0), x.stride(1), out.stride(0), out.stride(1))
    if schedule == "sgmv":
        _sgmv_shrink_kernel[plan.grid](
            x, a0, a1, a2, out, slot_ranks, sorted_rows, active_slots, seg_start, seg_len,
            k, plan.k_per_split, *strides, **plan.constexprs)
    else:
        _bgmv_shrink_kernel[plan.grid](
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
                       dora_shift_stacked is not None, _interpreted_bf16(y))
    strides = (buffer.stride(0), buffer.stride(1), y.stride(0), y.stride(1))
    if schedule == "sgmv":
        _sgmv_expand_kernel[plan.grid](
            buffer, b0, b1, b2, y, slot_ranks, sorted_rows, active_slots, seg_start, seg_len,
            *dora_args, n0, n1, n2, o0, o1, o2, plan.n_tiles, *strides, **plan.constexprs)
    else:
        _bgmv_expand_kernel[plan.grid](
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
    op = torch.ops.manylora.lora_expand if torch.compiler.is_compiling() else lora_expand_op
    op(y, buffer, list(lora_b_stacked), mapping.token_lora_indices, mapping.slot_ranks,
       mapping.sorted_rows, mapping.active_slots, mapping.seg_start, mapping.seg_len,
       mapping.max_seg_len, mapping.schedule, [offset for offset, _ in output_slices],
       mapping.slot_dora if dora else None, list(dora_scale_stacked) if dora else None,
       None if dora_shift_stacked is None else list(dora_shift_stacked))
