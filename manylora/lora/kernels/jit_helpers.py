"""The ``@triton.jit`` pieces the LoRA shrink/expand kernels share: one statement of each loop.

``sgmv_kernels`` (Punica's SGMV and BGMV, Chen et al. 2023) and ``tiled_kernels`` state their
semantics in their module docstrings. Each kernel maps its program to a slot, a slice ``s``
and a tile, returns early where there is nothing to do, and calls these helpers for the work:

* ``pick``: a slice's pointer, width or column offset; ``slot_rank`` / ``shard_rank``: the
  (slot, slice)'s rank from the rank table (clamped to the shard of A with ``rank_start``).
* ``row_tile``: the token rows of a tile of one slot's rows (SGMV segment tiles, tiled row
  tiles).
* ``shrink_row_tile``: the split-K ``tl.dot`` loop over ``in`` (``shrink_tile``) and the
  store (or float32 atomic add) into the buffer; ``store_or_add`` is that store, also
  BGMV's.
* ``expand_row_tile``: the ``tl.dot`` loop over the rank with B rank-major
  (``expand_tile``), and ``y + delta`` in float32 stored by ``store_expanded`` (BGMV's store
  too): DoRA's ``dora_rescale`` where the table flags it, rounded once to ``y``'s dtype.

``shrink_tile`` and ``expand_tile`` return the float32 tile, for kernels whose rows of x and
of the buffer differ (the MoE LoRA kernels of ``fused_moe_lora_kernels``: x by token, the
buffer by (token, expert) pair) or that scale the delta first.

Triton inlines a ``@triton.jit`` call into its caller, and specializes it on the caller's
constexprs (plain ints a kernel passes, such as a ``0``, arrive as constexprs as well), so a
kernel compiles to the code it would with these bodies written in place.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Kernel arguments not to specialize (``do_not_specialize``): the rank table's views start at
# each projection's column, and the DoRA flags and bias are absent (``y`` in their place) or
# views too; Triton would otherwise compile one kernel per alignment (16 bytes or not) and
# per int that happens to be 1 or a multiple of 16.
TABLE_ARGS = ["ranks_ptr", "stride_rank"]
DORA_ARGS = ["dora_ptr", "stride_dora", "bias_ptr"]


@triton.jit
def pick(s, v0, v1, v2):
    """The value of slice ``s`` (0, 1 or 2): a slice's pointer, width or column offset."""
    if s == 0:
        v = v0
    elif s == 1:
        v = v1
    else:
        v = v2
    return v


@triton.jit
def slot_rank(ranks_ptr, stride_rank, slot, s):
    """The rank of ``slot``'s adapter for slice ``s``: ``ranks[slot, s]`` of the table."""
    return tl.load(ranks_ptr + slot.to(tl.int64) * stride_rank + s)


@triton.jit
def shard_rank(ranks_ptr, stride_rank, slot, s, rank_start, R: tl.constexpr):
    """The rank rows of A a shrink reduces: ``clamp(ranks[slot, s] - rank_start, 0, R)``,
    A holding rank rows ``[rank_start, rank_start + R)`` (fully sharded column parallelism;
    ``rank_start`` 0 otherwise)."""
    return tl.minimum(tl.maximum(slot_rank(ranks_ptr, stride_rank, slot, s) - rank_start, 0), R)


@triton.jit
def row_tile(sorted_rows_ptr, start_ptr, run, m0, length, BLOCK_M: tl.constexpr):
    """``(rows, m_mask)`` of one tile of run ``run`` of a slot's rows (an SGMV segment, a
    row tile), which starts at ``sorted_rows[start[run]]`` and has ``length`` rows:
    ``rows[i] = sorted_rows[start[run] + m0 + i]`` as int64 for ``i < BLOCK_M``,
    ``m_mask[i] = m0 + i < length`` (row 0 where masked)."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    rows = tl.load(sorted_rows_ptr + tl.load(start_ptr + run) + offs_m, mask=m_mask,
                   other=0).to(tl.int64)
    return rows, m_mask


@triton.jit
def store_or_add(ptrs, values, mask, ATOMIC: tl.constexpr):
    """``*ptrs = values`` where ``mask``; with ``ATOMIC`` (split-K) ``*ptrs += values`` as
    relaxed float32 atomics into a zeroed buffer (the summation order varies)."""
    if ATOMIC:
        tl.atomic_add(ptrs, values, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, values, mask=mask)


@triton.jit
def shrink_tile(x_ptr, a_ptr, rows, m_mask, slot, rank, pid_r, pid_k, K, K_PER_SPLIT,
                stride_xt, stride_xk, R: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """The float32 ``[BLOCK_M, BLOCK_R]`` tile ``sum_k x[rows, k] * A[slot, c, k]`` for the
    rank columns ``c`` of tile ``pid_r`` below ``rank`` and ``k`` in split ``pid_k``
    (``[pid_k * K_PER_SPLIT, ...)``, below ``K``): ``tl.dot`` of ``[BLOCK_M, BLOCK_K]`` x and
    ``[BLOCK_R, BLOCK_K]`` A tiles (float32 operands with ``DOT_FP32``); zero in masked rows
    and columns.

    A is ``[num_slots, R, K]`` contiguous; masked rows, rank columns and ``k`` load nothing.
    """
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
    return acc


@triton.jit
def shrink_row_tile(x_ptr, a_ptr, out_ptr, rows, m_mask, slot, s, rank, pid_r, pid_k,
                    K, K_PER_SPLIT, stride_xt, stride_xk, stride_ot, stride_os,
                    R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr, DOT_FP32: tl.constexpr):
    """``buffer[rows, s, c] (+)= sum_k x[rows, k] * A[slot, c, k]``: the ``shrink_tile``,
    stored or atomically added (``ATOMIC``) into ``out`` (``[T, S, R]``)."""
    acc = shrink_tile(x_ptr, a_ptr, rows, m_mask, slot, rank, pid_r, pid_k, K, K_PER_SPLIT,
                      stride_xt, stride_xk, R, BLOCK_M, BLOCK_R, BLOCK_K, DOT_FP32)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    out_ptrs = out_ptr + rows[:, None] * stride_ot + s * stride_os + offs_r[None, :]
    store_or_add(out_ptrs, acc, m_mask[:, None] & (offs_r < rank)[None, :], ATOMIC)


@triton.jit
def dora_rescale(out, dora_ptr, stride_dora, sc0_ptr, sc1_ptr, sc2_ptr, bias_ptr, s, slot,
                 n_out, col0, offs_n, n_mask, HAS_SHIFT: tl.constexpr):
    """``out * scale + (1 - scale) * bias`` (bias only with ``HAS_SHIFT``) where the table
    flags (slot, s) DoRA, else ``out``; ``out`` float32 ``[..., BLOCK_N]`` over columns
    ``offs_n`` of slice ``s``, ``scale`` float32 ``[max_loras, n_out]``, ``bias`` indexed by
    ``y``'s columns ``col0 + offs_n``."""
    if tl.load(dora_ptr + slot.to(tl.int64) * stride_dora + s) != 0:
        p = pick(s, sc0_ptr, sc1_ptr, sc2_ptr)
        scale = tl.load(p + slot.to(tl.int64) * n_out + offs_n, mask=n_mask, other=1.0)
        out = out * scale
        if HAS_SHIFT:
            bias = tl.load(bias_ptr + col0 + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            out = out + (1.0 - scale) * bias
    return out


@triton.jit
def store_expanded(y_ptrs, out, mask, dora_ptr, stride_dora, sc0_ptr, sc1_ptr, sc2_ptr,
                   bias_ptr, s, slot, n_out, col0, offs_n, n_mask, HAS_DORA: tl.constexpr,
                   HAS_SHIFT: tl.constexpr):
    """``*y_ptrs = out`` where ``mask``, rounded once to ``y``'s dtype; ``out`` the float32
    ``y + delta`` of ``y_ptrs``' shape, whose last axis is the columns ``offs_n``. With
    ``HAS_DORA`` rescaled first (``dora_rescale``) where the table flags (slot, s)."""
    if HAS_DORA:
        out = dora_rescale(out, dora_ptr, stride_dora, sc0_ptr, sc1_ptr, sc2_ptr, bias_ptr,
                           s, slot, n_out, col0, offs_n, n_mask, HAS_SHIFT)
    tl.store(y_ptrs, out.to(y_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def expand_tile(buf_ptr, b_ptr, rows, m_mask, slot, s, rank, n_out, pid_n, stride_bt,
                stride_bs, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_R: tl.constexpr, DOT_FP32: tl.constexpr):
    """The float32 ``[BLOCK_M, BLOCK_N]`` tile ``delta = buffer[rows, s, :rank] @
    B[slot, :rank, n]`` for the columns ``n`` of output tile ``pid_n`` below ``n_out``:
    ``tl.dot`` over the rank in ``BLOCK_R`` steps, each buffer tile rounded to B's dtype
    first (float32 operands with ``DOT_FP32``), accumulated in float32.

    B is ``[num_slots, R, n_out]`` rank-major, contiguous: a ``[BLOCK_R, BLOCK_N]`` tile
    loads along ``out``; rank rows at or past ``rank`` and masked rows load nothing.
    """
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    offs_r = tl.arange(0, BLOCK_R)
    buf_ptrs = buf_ptr + rows[:, None] * stride_bt + s * stride_bs + offs_r[None, :]
    # offsets inside B[slot] in int32: BLOCK_R * n_out stays far below 2**31
    b_ptrs = (b_ptr + slot.to(tl.int64) * R * n_out + offs_r[:, None] * n_out
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
    return acc


@triton.jit
def expand_row_tile(buf_ptr, b_ptr, y_ptr, rows, m_mask, slot, s, rank, n_out, col0, pid_n,
                    dora_ptr, sc0_ptr, sc1_ptr, sc2_ptr, bias_ptr,
                    stride_bt, stride_bs, stride_yt, stride_yn, stride_dora,
                    R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_R: tl.constexpr, DOT_FP32: tl.constexpr, HAS_DORA: tl.constexpr,
                    HAS_SHIFT: tl.constexpr):
    """``y[rows, col0 + n] += delta`` (DoRA through ``store_expanded``) for the columns
    ``n`` of output tile ``pid_n`` below ``n_out``, ``delta`` the ``expand_tile``, added to
    ``y`` in float32 and rounded once to ``y``'s dtype."""
    acc = expand_tile(buf_ptr, b_ptr, rows, m_mask, slot, s, rank, n_out, pid_n, stride_bt,
                      stride_bs, R, BLOCK_M, BLOCK_N, BLOCK_R, DOT_FP32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    y_ptrs = y_ptr + rows[:, None] * stride_yt + (col0 + offs_n)[None, :] * stride_yn
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    store_expanded(y_ptrs, y.to(tl.float32) + acc, mask, dora_ptr, stride_dora, sc0_ptr,
                   sc1_ptr, sc2_ptr, bias_ptr, s, slot, n_out, col0, offs_n, n_mask, HAS_DORA,
                   HAS_SHIFT)
