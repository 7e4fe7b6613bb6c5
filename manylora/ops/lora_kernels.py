"""Triton kernels of batched multi-LoRA shrink/expand: Punica's SGMV and BGMV.

Follows Punica (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving") and vLLM's punica
Triton kernels: one launch applies every adapter of the step to every row, for all slices of
a packed projection (q/k/v, gate/up) at once. Two schedules over the same
:class:`~manylora.lora.punica.LoRAMapping`:

* SGMV (segmented gather matrix-vector, for prefill and popular adapters): a program owns a
  tile of ``BLOCK_M`` rows of one slot, gathered through ``sorted_rows``, and runs
  ``tl.dot`` on it; programs past their segment's length (or of an unused segment) exit at
  once.
* BGMV (batched gather matrix-vector, for decode with many distinct adapters): one program
  per token row (x output tile x slice) reads its slot from ``token_lora_indices`` and does
  a broadcast-multiply + ``tl.sum``; base rows (slot -1) exit at once.

Both read each slot's true rank from ``slot_ranks``: a rank-8 adapter in a rank-64 slot
buffer does rank-8 work. Shrink splits the reduction over ``in`` (split-K, fp32 atomics into
a zeroed buffer); expand tiles the output columns and stops its reduction at the rank.

Expand also fuses DoRA (Liu et al. 2024): a program whose slot is flagged in ``slot_dora``
stores ``(y + delta) * scale (+ shift)`` in float32, rounded once, and only such programs
load the scale/shift tiles; ``HAS_DORA`` / ``HAS_SHIFT`` are constexprs, so a launch without
DoRA arguments compiles to the plain kernel.

Launch sizes come from ``manylora.ops.lora_plans``; the ops that launch these kernels, and
their dispatcher registration, are in ``manylora.ops.triton_lora``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The per-step LoRAMapping tensors are views at offsets of one buffer that move with the row
# count, and N_TILES varies with the batch: Triton would otherwise compile one kernel per
# pointer alignment (16 bytes or not) and per int that happens to be 1 or a multiple of 16.
_SEGMENT_PTRS = ["slot_ranks_ptr", "sorted_rows_ptr", "active_slots_ptr", "seg_start_ptr",
                 "seg_len_ptr"]
_GATHER_PTRS = ["token_lora_ptr", "slot_ranks_ptr"]


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
def sgmv_shrink_kernel(
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
def bgmv_shrink_kernel(
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
def sgmv_expand_kernel(
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
def bgmv_expand_kernel(
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
