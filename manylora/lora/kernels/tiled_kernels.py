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
float32 atomics into a zeroed buffer); expand tiles the output columns. The loops over a row
tile are the ``@triton.jit`` helpers of ``lora/kernels/jit_helpers.py``, shared with the
SGMV kernels. Launches: ``lora/kernels/triton_lora_tiled.py``; launch heuristics:
``lora/kernels/tiled_plans.py``.
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
)

# The mapping's views sit at offsets that move with the row count: not specialized, as the
# table's arguments are not (``jit_helpers.TABLE_ARGS``).
_TILE_PTRS = ["sorted_rows_ptr", "tile_slot_ptr", "tile_start_ptr", "tile_len_ptr"]


@triton.jit(do_not_specialize=[*_TILE_PTRS, *TABLE_ARGS, "rank_start"])
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
    rank = shard_rank(ranks_ptr, stride_rank, slot, s, rank_start, R)
    if pid_r * BLOCK_R >= rank:
        return
    a_ptr = pick(s, a0_ptr, a1_ptr, a2_ptr)
    tile_len = tl.load(tile_len_ptr + tile)
    rows, m_mask = row_tile(sorted_rows_ptr, tile_start_ptr, tile, 0, tile_len, BLOCK_M)
    shrink_row_tile(x_ptr, a_ptr, out_ptr, rows, m_mask, slot, s, rank, pid_r, pid_k, K,
                    K_PER_SPLIT, stride_xt, stride_xk, stride_ot, stride_os,
                    R, BLOCK_M, BLOCK_R, BLOCK_K, ATOMIC, DOT_FP32)


@triton.jit(do_not_specialize=[*_TILE_PTRS, *TABLE_ARGS, *DORA_ARGS, "N_TILES"])
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
    rank = slot_rank(ranks_ptr, stride_rank, slot, s)
    if rank == 0:
        return
    n_out = pick(s, N0, N1, N2)
    if pid_n * BLOCK_N >= n_out:
        return
    b_ptr = pick(s, b0_ptr, b1_ptr, b2_ptr)
    col0 = pick(s, OFF0, OFF1, OFF2)
    tile_len = tl.load(tile_len_ptr + tile)
    rows, m_mask = row_tile(sorted_rows_ptr, tile_start_ptr, tile, 0, tile_len, BLOCK_M)
    expand_row_tile(buf_ptr, b_ptr, y_ptr, rows, m_mask, slot, s, rank, n_out, col0, pid_n,
                    dora_ptr, sc0_ptr, sc1_ptr, sc2_ptr, bias_ptr,
                    stride_bt, stride_bs, stride_yt, stride_yn, stride_dora,
                    R, BLOCK_M, BLOCK_N, BLOCK_R, DOT_FP32, HAS_DORA, HAS_SHIFT)
