"""Triton kernels of the tiled LoRA variant: each adapter read once per row tile, not per row.

The decode counterpart of Punica's SGMV (Chen et al. 2023): the step's LoRA rows, grouped by
slot (``LoRAKernelMeta.sorted_rows``), are cut on the host into tiles of at most ``BLOCK_M`` rows
of one slot (``lora.row_tiles``). A program owns one tile, so A's and B's tiles are read once
for up to ``BLOCK_M`` rows, and runs ``tl.dot`` on them (rows past the tile's length are
masked: no memory traffic, only idle tensor-core lanes). The grid is the tile count; programs
of padding tiles (slot -1) exit at once.

Semantics, for every slice ``s``, tile ``i`` with ``slot = tile_slot[i] >= 0``, its rows
``t in sorted_rows[tile_start[i] : tile_start[i] + tile_len[i]]`` and
``r = ranks[slot, s]`` (``ranks_ptr + slot * stride_rank + s``: the rank table's columns;
shrink: ``clamp(r - rank_start, 0, R)`` of A's rows under fully sharded parallelism)::

    shrink:  buffer[t, s, :r] = x[t] @ A_s[slot, :r]^T                    (float32)
    expand:  delta = buffer[t, s, :r] @ B_s[slot, :r]                     (B rank-major)
             y[t, cols_s] += delta                                        (plain)
             y[t, cols_s] = (y[t, cols_s] + delta) * scale_s[slot]
                            + (1 - scale_s[slot]) * bias[cols_s]          (dora[slot, s] = 1)

A program whose (slot, slice) has rank 0, or whose rank tile starts past the rank, returns
before it loads x, A, B, the buffer or y. Shrink splits the reduction over ``in`` (split-K,
float32 atomics into a zeroed buffer); expand tiles the output columns. Launches:
``lora/kernels/triton_lora_tiled.py``; launch heuristics: ``lora/kernels/tiled_plans.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

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


@triton.jit(do_not_specialize=[*_TILE_PTRS, "stride_rank", "rank_start"])
def tiled_shrink_kernel(
        x_ptr, a0_ptr, a1_ptr, a2_ptr, out_ptr, ranks_ptr,
        sorted_rows_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr,
        K, stride_xt, stride_xk, stride_ot, stride_os, stride_rank, rank_start,
        K_PER_SPLIT: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr, DOT_FP32: tl.constexpr):
    """Grid ``(num_tiles * r_tiles, split_k, NUM_SLICES)``. A holds rank rows
    ``[rank_start, rank_start + R)``: a program reduces ``clamp(rank - rank_start, 0, R)``
    of them."""
    R_TILES: tl.constexpr = (R + BLOCK_R - 1) // BLOCK_R
    tile = tl.program_id(0) // R_TILES
    pid_r = tl.program_id(0) % R_TILES
    pid_k = tl.program_id(1)
    s = tl.program_id(2)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot.to(tl.int64) * stride_rank + s)
    rank = tl.minimum(tl.maximum(rank - rank_start, 0), R)
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


@triton.jit(do_not_specialize=[*_TILE_PTRS, "stride_rank", "dora_ptr", "stride_dora",
                               "bias_ptr", "N_TILES"])
def tiled_expand_kernel(
        buf_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, ranks_ptr,
        sorted_rows_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr,
        dora_ptr, sc0_ptr, sc1_ptr, sc2_ptr, bias_ptr,
        N0, N1, N2, OFF0, OFF1, OFF2, N_TILES,
        stride_bt, stride_bs, stride_yt, stride_yn, stride_rank, stride_dora,
        R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr, DOT_FP32: tl.constexpr, HAS_DORA: tl.constexpr,
        HAS_SHIFT: tl.constexpr):
    """Grid ``(num_tiles * n_tiles, NUM_SLICES)``. B ``[max_loras, R, n_out]`` rank-major,
    read rows ``[0, rank)``. With ``HAS_DORA`` a (slot, slice) flagged in ``dora`` stores
    ``(y + delta) * scale (+ (1 - scale) * bias)``, the bias indexed by ``y``'s columns."""
    tile = tl.program_id(0) // N_TILES
    pid_n = tl.program_id(0) % N_TILES
    s = tl.program_id(1)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot.to(tl.int64) * stride_rank + s)
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
    for r0 in tl.static_range(0, R, BLOCK_R):
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
        if tl.load(dora_ptr + slot.to(tl.int64) * stride_dora + s) != 0:
            sc_ptr = _pick(s, sc0_ptr, sc1_ptr, sc2_ptr)
            scale = tl.load(sc_ptr + slot.to(tl.int64) * n_out + offs_n, mask=n_mask, other=1.0)
            out = out * scale[None, :]
            if HAS_SHIFT:
                bias = tl.load(bias_ptr + col0 + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                out = out + ((1.0 - scale) * bias)[None, :]
    tl.store(y_ptrs, out.to(y.dtype), mask=mask)
