"""Triton kernels of batched multi-LoRA shrink/expand: Punica's SGMV and BGMV.

Follows Punica (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving") and vLLM's punica
Triton kernels: one launch applies every adapter of the step to every row, for all slices of
a packed projection (q/k/v, gate/up) at once. Two variants over the same
:class:`~manylora.lora.kernels.meta.LoRAKernelMeta`:

* SGMV (segmented gather matrix-vector, for prefill and popular adapters): a program owns a
  tile of ``BLOCK_M`` rows of one slot, gathered through ``sorted_rows``, and runs
  ``tl.dot`` on it; programs past their segment's length (or of an unused segment) exit at
  once.
* BGMV (batched gather matrix-vector, for decode with many distinct adapters): one program
  per token row (x output tile x slice) reads its slot from ``token_lora_indices`` and does
  a broadcast-multiply + ``tl.sum``; base rows (slot -1) exit at once.

Every program reads its (slot, slice)'s rank from the model's ``SlotTable`` right after
its slot, ``rank = ranks[slot * stride_rank + s]`` (the projection's columns of the table),
and returns when it is 0 (the slot's adapter does not target that module) or when its rank
tile starts past it, before it reads x, A, B or y: an untargeted module costs a few int32
loads per program and leaves ``y`` untouched, and a rank-8 ``rank_pattern`` module of a
rank-64 adapter does rank-8 work. Nothing past a (slot, slice)'s rank is read, so the slot
buffers need no zero padding. Shrink splits the reduction over ``in`` (split-K, fp32
atomics into a zeroed buffer); expand tiles the output columns and reads B rank-major
(``[max_loras, R, out_s]``, loads coalesced along ``out``) up to exactly the rank.

Expand also fuses DoRA (Liu et al. 2024): a program whose (slot, slice) is flagged in the
table's ``dora`` stores ``(y + delta) * scale + (1 - scale) * bias`` in float32, rounded
once, and only such programs load the scale (and bias) tiles; ``HAS_DORA`` / ``HAS_SHIFT``
(a bias to shift by) are constexprs, so a launch without DoRA arguments compiles to the
plain kernel.

The SGMV kernels' row-tile loops, the rank reads, the stores and the DoRA epilogue are the
``@triton.jit`` helpers of ``manylora.lora.kernels.jit_helpers``, shared with the tiled
kernels. Launch sizes come from ``manylora.lora.kernels.plans``; the ops that launch these
kernels, and their dispatcher registration, are in ``manylora.lora.kernels.triton_lora``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from manylora.lora.kernels.jit_helpers import (
    DORA_ARGS,
    TABLE_ARGS,
    expand_row_tile,
    pick,
    row_tile,
    shard_rank,
    shrink_row_tile,
    slot_rank,
    store_expanded,
    store_or_add,
)

# The per-step LoRAKernelMeta tensors are views at offsets of one buffer that move with the row
# count, and N_TILES varies with the batch: not specialized, as the table's arguments are not
# (``jit_helpers.TABLE_ARGS``).
_SEGMENT_PTRS = ["sorted_rows_ptr", "active_slots_ptr", "seg_start_ptr", "seg_len_ptr"]
_GATHER_PTRS = ["token_lora_ptr"]


@triton.jit(do_not_specialize=[*_SEGMENT_PTRS, *TABLE_ARGS, "rank_start"])
def sgmv_shrink_kernel(
        x_ptr, a0_ptr, a1_ptr, a2_ptr, out_ptr,
        ranks_ptr, sorted_rows_ptr, active_slots_ptr, seg_start_ptr, seg_len_ptr,
        K, K_PER_SPLIT, stride_xt, stride_xk, stride_ot, stride_os, stride_rank, rank_start,
        R: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
        DOT_FP32: tl.constexpr):
    """Grid ``(m_tiles * r_tiles, split_k, max_loras * NUM_SLICES)``. A holds rank rows
    ``[rank_start, rank_start + R)``: a program reduces ``clamp(rank - rank_start, 0, R)``
    of them."""
    R_TILES: tl.constexpr = (R + BLOCK_R - 1) // BLOCK_R
    pid_m = tl.program_id(0) // R_TILES
    pid_r = tl.program_id(0) % R_TILES
    pid_k = tl.program_id(1)
    seg = tl.program_id(2) // NUM_SLICES
    s = tl.program_id(2) % NUM_SLICES
    slot = tl.load(active_slots_ptr + seg)
    if slot < 0:
        return
    rank = shard_rank(ranks_ptr, stride_rank, slot, s, rank_start, R)
    if pid_r * BLOCK_R >= rank:
        return
    seg_len = tl.load(seg_len_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    a_ptr = pick(s, a0_ptr, a1_ptr, a2_ptr)
    rows, m_mask = row_tile(sorted_rows_ptr, seg_start_ptr, seg, pid_m * BLOCK_M, seg_len,
                            BLOCK_M)
    shrink_row_tile(x_ptr, a_ptr, out_ptr, rows, m_mask, slot, s, rank, pid_r, pid_k, K,
                    K_PER_SPLIT, stride_xt, stride_xk, stride_ot, stride_os,
                    R, BLOCK_M, BLOCK_R, BLOCK_K, ATOMIC, DOT_FP32)


@triton.jit(do_not_specialize=[*_GATHER_PTRS, *TABLE_ARGS, "rank_start"])
def bgmv_shrink_kernel(
        x_ptr, a0_ptr, a1_ptr, a2_ptr, out_ptr, token_lora_ptr, ranks_ptr,
        K, K_PER_SPLIT, stride_xt, stride_xk, stride_ot, stride_os, stride_rank, rank_start,
        R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr):
    """Grid ``(T * r_tiles, split_k, NUM_SLICES)``; ranks as ``sgmv_shrink_kernel``'s. A
    broadcast-multiply over ``[BLOCK_R, BLOCK_K]`` tiles of A, summed over ``k`` last."""
    R_TILES: tl.constexpr = (R + BLOCK_R - 1) // BLOCK_R
    t = tl.program_id(0) // R_TILES
    pid_r = tl.program_id(0) % R_TILES
    pid_k = tl.program_id(1)
    s = tl.program_id(2)
    slot = tl.load(token_lora_ptr + t)
    if slot < 0:
        return
    rank = shard_rank(ranks_ptr, stride_rank, slot, s, rank_start, R)
    if pid_r * BLOCK_R >= rank:
        return
    a_ptr = pick(s, a0_ptr, a1_ptr, a2_ptr)

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
    store_or_add(out_ptrs, tl.sum(acc, axis=1), r_mask, ATOMIC)


@triton.jit(do_not_specialize=[*_SEGMENT_PTRS, *TABLE_ARGS, *DORA_ARGS, "N_TILES"])
def sgmv_expand_kernel(
        buf_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr,
        ranks_ptr, sorted_rows_ptr, active_slots_ptr, seg_start_ptr, seg_len_ptr,
        dora_ptr, sc0_ptr, sc1_ptr, sc2_ptr, bias_ptr,
        N0, N1, N2, OFF0, OFF1, OFF2, N_TILES,
        stride_bt, stride_bs, stride_yt, stride_yn, stride_rank, stride_dora,
        R: tl.constexpr, NUM_SLICES: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        DOT_FP32: tl.constexpr, HAS_DORA: tl.constexpr, HAS_SHIFT: tl.constexpr):
    """Grid ``(m_tiles * n_tiles, max_loras * NUM_SLICES)``. B ``[max_loras, R, n_out]``
    rank-major, read rows ``[0, rank)``. With ``HAS_DORA`` a program of a (slot, slice) the
    table flags DoRA stores ``(y + delta) * scale (+ (1 - scale) * bias)``."""
    pid_m = tl.program_id(0) // N_TILES
    pid_n = tl.program_id(0) % N_TILES
    seg = tl.program_id(1) // NUM_SLICES
    s = tl.program_id(1) % NUM_SLICES
    slot = tl.load(active_slots_ptr + seg)
    if slot < 0:
        return
    rank = slot_rank(ranks_ptr, stride_rank, slot, s)
    if rank == 0:
        return
    seg_len = tl.load(seg_len_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    b_ptr = pick(s, b0_ptr, b1_ptr, b2_ptr)
    n_out = pick(s, N0, N1, N2)
    col0 = pick(s, OFF0, OFF1, OFF2)
    if pid_n * BLOCK_N >= n_out:
        return
    rows, m_mask = row_tile(sorted_rows_ptr, seg_start_ptr, seg, pid_m * BLOCK_M, seg_len,
                            BLOCK_M)
    expand_row_tile(buf_ptr, b_ptr, y_ptr, rows, m_mask, slot, s, rank, n_out, col0, pid_n,
                    dora_ptr, sc0_ptr, sc1_ptr, sc2_ptr, bias_ptr,
                    stride_bt, stride_bs, stride_yt, stride_yn, stride_dora,
                    R, BLOCK_M, BLOCK_N, BLOCK_R, DOT_FP32, HAS_DORA, HAS_SHIFT)


@triton.jit(do_not_specialize=[*_GATHER_PTRS, *TABLE_ARGS, *DORA_ARGS])
def bgmv_expand_kernel(
        buf_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, token_lora_ptr, ranks_ptr,
        dora_ptr, sc0_ptr, sc1_ptr, sc2_ptr, bias_ptr,
        N0, N1, N2, OFF0, OFF1, OFF2,
        stride_bt, stride_bs, stride_yt, stride_yn, stride_rank, stride_dora,
        R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        HAS_DORA: tl.constexpr, HAS_SHIFT: tl.constexpr):
    """Grid ``(T, n_tiles, NUM_SLICES)``; B and DoRA as ``sgmv_expand_kernel``'s. A
    broadcast-multiply over ``[BLOCK_N, BLOCK_R]`` tiles of B, summed over the rank last."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = tl.program_id(2)
    slot = tl.load(token_lora_ptr + t)
    if slot < 0:
        return
    rank = slot_rank(ranks_ptr, stride_rank, slot, s)
    if rank == 0:
        return
    b_ptr = pick(s, b0_ptr, b1_ptr, b2_ptr)
    n_out = pick(s, N0, N1, N2)
    col0 = pick(s, OFF0, OFF1, OFF2)
    if pid_n * BLOCK_N >= n_out:
        return

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    offs_r = tl.arange(0, BLOCK_R)
    buf_ptrs = buf_ptr + t.to(tl.int64) * stride_bt + s * stride_bs + offs_r
    # B[slot] is [R, n_out], out fastest: the [BLOCK_N, BLOCK_R] tile loads along out.
    b_ptrs = (b_ptr + slot.to(tl.int64) * R * n_out + offs_r[None, :] * n_out
              + offs_n[:, None])
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for r0 in tl.static_range(0, R, BLOCK_R):
        r_mask = r0 + offs_r < rank
        v = tl.load(buf_ptrs, mask=r_mask, other=0.0)
        bt = tl.load(b_ptrs, mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        acc += bt.to(tl.float32) * v[None, :]
        buf_ptrs += BLOCK_R
        b_ptrs += BLOCK_R * n_out

    y_ptrs = y_ptr + t.to(tl.int64) * stride_yt + (col0 + offs_n) * stride_yn
    y = tl.load(y_ptrs, mask=n_mask, other=0.0)
    store_expanded(y_ptrs, y.to(tl.float32) + tl.sum(acc, axis=1), n_mask, dora_ptr,
                   stride_dora, sc0_ptr, sc1_ptr, sc2_ptr, bias_ptr, s, slot, n_out, col0,
                   offs_n, n_mask, HAS_DORA, HAS_SHIFT)
