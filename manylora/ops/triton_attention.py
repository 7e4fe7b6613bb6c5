"""Triton kernels: paged KV write and paged attention (prefill, chunked prefill, decode; GQA).

Computes the formula of ``manylora.ops.attention``: for query ``j`` of a sequence at
position ``qp = context_len - query_len + j``::

    s[j, h, kp] = q[j, h] · k[kp, h // G] * scale
    s[j, h, kp] = cap * tanh(s[j, h, kp] / cap)          (soft-capping, when cap is given)
    out[j, h] = softmax_kp(s[j, h, kp]) @ v[kp, h // G]
    over kp ≤ qp (and qp - kp < window), zeros when no key is visible.

With a quantized cache (``KVCache.scale`` not None) the rows are dequantized, ``k[kp, g] =
kc[kp, g] * ks[kp, g]`` and ``v[kp, g] = vc[kp, g] * vs[kp, g]`` (int8 / float8 e4m3 codes,
one float32 scale per position and KV head), and the kernel computes, with ``p`` the
softmax numerators::

    s[r, kp]  = (q[r] · kc[kp]) * ks[kp] * scale          (then capped as above)
    out[r]    = Σ_kp (p[r, kp] * vs[kp]) · vc[kp] / Σ_kp p[r, kp]

The codes convert exactly to the dot dtype (int8 and e4m3 values are bfloat16, float16 and
float32 numbers), so the scales are the only extra rounding against attention over the
dequantized rows. ``write_kv_triton`` quantizes as ``manylora.ops.paged_kv.quantize_kv``:
``scale = max_d |x[d]| / QMAX`` per (token, KV head), ``code = round(x / scale)``.

Design (FlashAttention-2's forward, Dao 2023, over vLLM's paged KV cache, Kwon et al. 2023,
organised like vLLM's Triton "unified attention"):

* A program owns one *tile* of ``AttentionMetadata`` (a sequence and its first query) and one
  KV head. Its rows are ``BLOCK_Q`` query tokens × the ``G`` query heads sharing that KV head
  (row ``r`` = token ``r // G``, head ``kv_head * G + r % G``), padded to ``BLOCK_M``, a power
  of two ≥ 16 for ``tl.dot``. Each KV head's keys are thus read once for all G heads.
* It walks key tiles of ``BLOCK_N`` positions from the window start to its causal limit,
  gathers each key/value row through the block table (``block_table[kp // block_size]``, any
  block_size), and keeps the FlashAttention-2 online softmax in float32 (base-2 exponent,
  scale folded into ``log2 e``; with soft-capping the scale divided by the cap goes inside
  the tanh and ``cap · log2 e`` outside it). Key tiles that every row of the tile sees in
  full skip the mask; only the tiles on the causal diagonal and at the window start are masked.
* Two launches share the kernel: decode tiles (``BLOCK_Q`` 1, ``BLOCK_M`` = max(16, G)) and
  prefill tiles (``BLOCK_Q = metadata.prefill_block_q``, 128 rows for G ≤ 128). When the
  decode launch has fewer programs than the GPU has SMs, its key range is split over a third
  grid axis (flash-decoding): each split writes an unnormalised partial output with its row
  max and sum, and a second kernel combines them.
* Grids, tile sizes and split counts come from host ints and shapes only (no autotune, no
  device→host sync): both entry points are CUDA-graph safe. ``tile_config`` holds the tile
  heuristics: 16-bit prefill 128 × 64 tiles on 8 warps, decode 16-row tiles × 64 keys.

float32 inputs use ``input_precision="ieee"`` dots (exact float32, not TF32, on FMA units),
walking a tile in passes of 16 rows to keep those dots in registers; bfloat16 and float16
use tensor cores with float32 accumulation (P rounded to the input dtype, as FlashAttention).
head_dim need not be a power of two (padded to ≥ 16 and masked). Under
``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (bfloat16 dots widened to float32
there: the interpreter multiplies bfloat16 bit patterns as integers). Quantization is chosen
by the ``QUANT`` constexpr and soft-capping by ``SOFTCAP``, so the unquantized, uncapped
kernels compile to the same code as without them; their scale pointers get a never-read
float32 dummy. The interpreter's float32 → float8 cast does not round correctly (it drops
the carry from the mantissa into the exponent), so only the float8 *write* is wrong there;
reading float8 codes is exact.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from manylora.ops.attention_metadata import (
    AttentionMetadata,
    check_attention_inputs,
    check_softcap,
)
from manylora.ops.host_math import cdiv, next_power_of_2
from manylora.ops.paged_kv import KV_QUANT_MAX, KVCache, check_kv_cache

_LOG2E = 1.4426950408889634
#: Upper bound on the key-range splits of a decode launch.
MAX_SPLITS = 32
#: SMs assumed for the split heuristic when not on CUDA (Triton's interpreter).
_CPU_SM_COUNT = 4
# Arguments that change from step to step: the AttentionMetadata tensors are views at
# offsets of one buffer that move with the batch, the table width (stride_bt) follows the
# longest sequence of an eager step. Not specialized (alignment, == 1, % 16), so that the
# kernels compiled at start-up serve every step.
_STEP_ARGS = ["block_tables_ptr", "query_start_ptr", "query_lens_ptr", "context_lens_ptr",
              "tile_seq_ptr", "tile_query_ptr", "num_tiles", "stride_bt"]


@triton.jit
def _quantize_store(x, data_ptrs, scale_ptrs, mask, row_mask, QMAX: tl.constexpr):
    """Quantize ``x [HEADS_PAD, HEAD_DIM_PAD]`` (zeros where masked) per row (KV head)::

        scale = max_d |x[d]| / QMAX,   code[d] = round(x[d] / scale), clamped to ±QMAX

    (``x / 1`` where scale is 0; int8 rounds half to even, float8 by its RTNE cast) and
    store the codes at ``data_ptrs`` and the scales at ``scale_ptrs [HEADS_PAD]``. Both
    divisions round correctly (``div_rn``), as the PyTorch reference's.
    """
    x = x.to(tl.float32)
    scale = tl.math.div_rn(tl.max(tl.abs(x), 1), QMAX)                 # [HEADS_PAD]
    y = tl.math.div_rn(x, tl.where(scale == 0.0, 1.0, scale)[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if data_ptrs.dtype.element_ty == tl.int8:
        # Round half to even: |y| ≤ 127, so y + 1.5·2^23 keeps no fraction bits.
        y = (y + 12582912.0) - 12582912.0
    tl.store(data_ptrs, y.to(data_ptrs.dtype.element_ty), mask=mask)
    tl.store(scale_ptrs, scale, mask=row_mask)


@triton.jit(do_not_specialize=["loc_ptr"])
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                     loc_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr):
    """One program per token row: copy its K and V heads into its cache location (skip -1);
    ``QUANT``: store their codes and per-head scales instead (``_quantize_store``)."""
    t = tl.program_id(0)
    loc = tl.load(loc_ptr + t)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM) & (h * 0 + loc >= 0)   # block-shaped test
    heads = tl.arange(0, HEADS_PAD)
    row_mask = (heads < NUM_KV_HEADS) & (heads * 0 + loc >= 0)
    loc = tl.maximum(loc, 0)
    dst = (loc // BLOCK_SIZE) * stride_cb + (loc % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    row = t.to(tl.int64)
    if QUANT:
        s_dst = (loc // BLOCK_SIZE) * stride_sb + (loc % BLOCK_SIZE) * stride_ss + heads
        k = tl.load(k_ptr + row * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
        _quantize_store(k, k_cache_ptr + dst, k_scale_ptr + s_dst, mask, row_mask, QMAX)
        v = tl.load(v_ptr + row * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
        _quantize_store(v, v_cache_ptr + dst, v_scale_ptr + s_dst, mask, row_mask, QMAX)
    else:
        k = tl.load(k_ptr + row * stride_kt + h * stride_kh + d, mask=mask)
        tl.store(k_cache_ptr + dst, k, mask=mask)
        v = tl.load(v_ptr + row * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _tanh(x):
    """``tanh(x) = sign(x) (1 - e^(-2|x|)) / (1 + e^(-2|x|))`` in float32: the exponential
    is at most 1, so nothing overflows at any ``|x|`` (the interpreter and the GPU alike)."""
    t = tl.exp2(-2.8853900817779268 * tl.abs(x))                  # e^(-2|x|): 2 log2 e
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0.0, -y, y)


@triton.jit
def _key_tiles(acc, l_i, m_i, q, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, j_start, j_end,
               q_pos, ctx, window, qk_scale, softcap, offs_n, offs_d, stride_cb, stride_cs,
               stride_sb, stride_ss, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr,
               USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
               UPCAST_DOT: tl.constexpr, QUANT: tl.constexpr, IN_DTYPE: tl.constexpr,
               SOFTCAP: tl.constexpr):
    """Online softmax over key tiles ``j_start .. j_end - 1`` (positions ``j * BLOCK_N ..``).

    ``MASKED`` tiles apply the causal / window / context mask; the others are seen in full
    by every row. ``m_i`` is the running row max of the base-2 logits, ``l_i`` the running
    sum of their exponentials, ``acc`` the unnormalised output. ``QUANT``: K and V tiles hold
    int8 / float8 codes, converted exactly to the dot dtype; the per-position scales multiply
    the logit columns (``s[:, n] *= k_scale[n]``) and the probability columns fed to the PV
    dot (``p[:, n] * v_scale[n]``, after ``l_i`` took the unscaled ``p``; for float16
    ``p[:, n] * v_scale[n] / max(v_scale)`` and the dot times ``max(v_scale)``, so that small
    scales do not underflow float16). ``SOFTCAP``: ``qk_scale`` is ``scale / cap`` and the
    logits are ``softcap · tanh(q · k · qk_scale)`` with ``softcap = cap · log2 e``.
    """
    d_mask = offs_d < HEAD_DIM
    for j in range(j_start, j_end):
        k_pos = j * BLOCK_N + offs_n                                   # [BLOCK_N]
        if MASKED:
            k_valid = k_pos < ctx
            block = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
            kv_mask = k_valid[None, :] & d_mask[:, None]
        else:
            block = tl.load(table_ptr + k_pos // BLOCK_SIZE)
            kv_mask = d_mask[:, None]
        row_off = block.to(tl.int64) * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs
        kv_off = row_off[None, :] + offs_d[:, None]                    # [HEAD_DIM_PAD, BLOCK_N]
        if MASKED or HEAD_DIM != HEAD_DIM_PAD:
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_ptr + kv_off)
        if QUANT:
            s_off = block.to(tl.int64) * stride_sb + (k_pos % BLOCK_SIZE) * stride_ss
            if MASKED:
                k_scale = tl.load(ks_ptr + s_off, mask=k_valid, other=0.0)
                v_scale = tl.load(vs_ptr + s_off, mask=k_valid, other=0.0)
            else:
                k_scale = tl.load(ks_ptr + s_off)
                v_scale = tl.load(vs_ptr + s_off)
            k = k.to(tl.float32).to(q.dtype)                          # exact: int8 / e4m3
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * (k_scale * qk_scale)[None, :]
        else:
            if UPCAST_DOT:
                k = k.to(tl.float32)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            s = softcap * _tanh(s)
        if MASKED:
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
            if USE_WINDOW:
                visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)      # rows with nothing seen
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = row_off[:, None] + offs_d[None, :]                    # [BLOCK_N, HEAD_DIM_PAD]
        if MASKED:
            v = tl.load(v_ptr + v_off, mask=k_valid[:, None] & d_mask[None, :], other=0.0)
        elif HEAD_DIM != HEAD_DIM_PAD:
            v = tl.load(v_ptr + v_off, mask=d_mask[None, :], other=0.0)
        else:
            v = tl.load(v_ptr + v_off)
        if QUANT:
            if IN_DTYPE == tl.float16:
                # float16's exponent is narrow: p * v_scale of a small-valued V row would
                # underflow. Scale by v_scale / (the tile's largest) and the product by it.
                vs_max = tl.max(v_scale, 0)
                vs_max = tl.where(vs_max > 0.0, vs_max, 1.0)
                p = (p * (v_scale * (1.0 / vs_max))[None, :]).to(IN_DTYPE)
            else:
                p = (p * v_scale[None, :]).to(IN_DTYPE)
            v = v.to(tl.float32).to(IN_DTYPE)
        else:
            p = p.to(v.dtype)
        if UPCAST_DOT:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        pv = tl.dot(p, v, input_precision=DOT_PRECISION)
        if QUANT:
            if IN_DTYPE == tl.float16:
                pv = pv * vs_max
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_rows(row0, tile, kv_head, split, seq, q_first, q_start, q_len, ctx,
                 out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_cache_ptr,
                 v_scale_cache_ptr, block_tables_ptr, part_acc_ptr, part_ml_ptr, qk_scale,
                 softcap, window, num_tiles, num_heads, stride_qt, stride_qh, stride_ot,
                 stride_oh, stride_cb, stride_cs, stride_ch, stride_bt, stride_sb, stride_ss,
                 G: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, USE_WINDOW: tl.constexpr,
                 NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 UPCAST_DOT: tl.constexpr, QUANT: tl.constexpr, SOFTCAP: tl.constexpr):
    """Rows ``row0 .. row0 + ROWS - 1`` of a tile (row = token ``row // G``, head
    ``kv_head * G + row % G``) over the keys they see, in one online-softmax pass."""
    rows = row0 + tl.arange(0, ROWS)
    tok = q_first + rows // G
    head = kv_head * G + rows % G
    row_valid = (rows < BLOCK_Q * G) & (tok < q_len)
    q_pos = ctx - q_len + tok
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    q_row = (q_start + tok).to(tl.int64)
    q_mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # Keys [lo, hi) are seen by some row, [full_lo, full_hi) by every row of the pass.
    first_tok = q_first + row0 // G
    last_tok = tl.minimum(q_first + (tl.minimum(row0 + ROWS, BLOCK_Q * G) - 1) // G, q_len - 1)
    first_pos = ctx - q_len + first_tok                # -1 only for padding sequences
    last_pos = ctx - q_len + last_tok
    hi = last_pos + 1
    full_hi = first_pos + 1
    lo = 0
    full_lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
        full_lo = tl.maximum(last_pos - window + 1, 0)
    j_lo = lo // BLOCK_N
    j_hi = (hi + BLOCK_N - 1) // BLOCK_N
    if NUM_SPLITS > 1:
        per_split = (j_hi - j_lo + NUM_SPLITS - 1) // NUM_SPLITS
        j_lo = tl.minimum(j_lo + split * per_split, j_hi)
        j_hi = tl.minimum(j_lo + per_split, j_hi)
    jf_lo = tl.minimum(tl.maximum((full_lo + BLOCK_N - 1) // BLOCK_N, j_lo), j_hi)
    jf_hi = tl.minimum(tl.maximum(full_hi // BLOCK_N, jf_lo), j_hi)

    k_ptr = k_cache_ptr + kv_head * stride_ch
    v_ptr = v_cache_ptr + kv_head * stride_ch
    ks_ptr = k_scale_cache_ptr + kv_head                 # scales: [blocks, block_size, Hkv]
    vs_ptr = v_scale_cache_ptr + kv_head
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _key_tiles(acc, l_i, m_i, q, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, j_lo,
                               jf_lo, q_pos, ctx, window, qk_scale, softcap, offs_n, offs_d,
                               stride_cb, stride_cs, stride_sb, stride_ss, BLOCK_SIZE, BLOCK_N,
                               HEAD_DIM, HEAD_DIM_PAD, True, USE_WINDOW, DOT_PRECISION,
                               UPCAST_DOT, QUANT, q_ptr.dtype.element_ty, SOFTCAP)
    acc, l_i, m_i = _key_tiles(acc, l_i, m_i, q, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, jf_lo,
                               jf_hi, q_pos, ctx, window, qk_scale, softcap, offs_n, offs_d,
                               stride_cb, stride_cs, stride_sb, stride_ss, BLOCK_SIZE, BLOCK_N,
                               HEAD_DIM, HEAD_DIM_PAD, False, USE_WINDOW, DOT_PRECISION,
                               UPCAST_DOT, QUANT, q_ptr.dtype.element_ty, SOFTCAP)
    acc, l_i, m_i = _key_tiles(acc, l_i, m_i, q, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, jf_hi,
                               j_hi, q_pos, ctx, window, qk_scale, softcap, offs_n, offs_d,
                               stride_cb, stride_cs, stride_sb, stride_ss, BLOCK_SIZE, BLOCK_N,
                               HEAD_DIM, HEAD_DIM_PAD, True, USE_WINDOW, DOT_PRECISION,
                               UPCAST_DOT, QUANT, q_ptr.dtype.element_ty, SOFTCAP)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Decode tiles only (BLOCK_Q 1): partials at [split, tile, head], combined later.
        w_row = (split * num_tiles + tile).to(tl.int64) * num_heads + head
        tl.store(part_acc_ptr + w_row[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(part_ml_ptr + w_row, m_i, mask=row_valid)
        tl.store(part_ml_ptr + NUM_SPLITS * num_tiles * num_heads + w_row, l_i, mask=row_valid)


@triton.jit(do_not_specialize=_STEP_ARGS)
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_cache_ptr, v_scale_cache_ptr,
        block_tables_ptr, query_start_ptr, query_lens_ptr, context_lens_ptr,
        tile_seq_ptr, tile_query_ptr, part_acc_ptr, part_ml_ptr,
        qk_scale, softcap, window, num_tiles, num_heads,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_cs, stride_ch, stride_bt, stride_sb, stride_ss,
        G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, PASS_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr, USE_WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, QUANT: tl.constexpr,
        SOFTCAP: tl.constexpr):
    """Program (tile, kv_head, split): ``BLOCK_Q`` queries × ``G`` heads (``BLOCK_M`` rows)
    over one key range, in passes of ``PASS_M`` rows (one pass unless float32 FMA dots).
    ``QUANT``: the cache holds codes whose float32 scales (``[blocks, block_size, Hkv]``,
    strides ``stride_sb``, ``stride_ss``, 1) are at ``k/v_scale_cache_ptr``. ``SOFTCAP``: the
    logits are soft-capped (``_key_tiles``)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    q_first = tl.load(tile_query_ptr + tile)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_lens_ptr + seq)
    ctx = tl.load(context_lens_ptr + seq)
    if PASS_M == BLOCK_M:
        _attend_rows(0, tile, kv_head, split, seq, q_first, q_start, q_len, ctx,
                     out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_cache_ptr,
                     v_scale_cache_ptr, block_tables_ptr, part_acc_ptr, part_ml_ptr, qk_scale,
                     softcap, window, num_tiles, num_heads, stride_qt, stride_qh, stride_ot,
                     stride_oh, stride_cb, stride_cs, stride_ch, stride_bt, stride_sb, stride_ss,
                     G, BLOCK_Q, PASS_M, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD,
                     USE_WINDOW, NUM_SPLITS, DOT_PRECISION, UPCAST_DOT, QUANT, SOFTCAP)
    else:
        num_rows = tl.minimum(BLOCK_Q, q_len - q_first) * G
        for row0 in range(0, num_rows, PASS_M):
            _attend_rows(row0, tile, kv_head, split, seq, q_first, q_start, q_len, ctx,
                         out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_cache_ptr,
                         v_scale_cache_ptr, block_tables_ptr, part_acc_ptr, part_ml_ptr,
                         qk_scale, softcap, window, num_tiles, num_heads, stride_qt,
                         stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
                         stride_bt, stride_sb, stride_ss, G, BLOCK_Q, PASS_M, BLOCK_N,
                         BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, USE_WINDOW, NUM_SPLITS,
                         DOT_PRECISION, UPCAST_DOT, QUANT, SOFTCAP)


@triton.jit(do_not_specialize=["tile_seq_ptr", "query_start_ptr", "num_tiles"])
def _combine_splits_kernel(out_ptr, part_acc_ptr, part_ml_ptr, tile_seq_ptr, query_start_ptr,
                           num_tiles, num_heads, stride_ot, stride_oh,
                           NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                           HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Program (decode tile, head): ``out = Σ_s acc_s 2^(m_s - M) / Σ_s l_s 2^(m_s - M)``."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(query_start_ptr + tl.load(tile_seq_ptr + tile)).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    s_mask = s < NUM_SPLITS
    w_row = (s * num_tiles + tile).to(tl.int64) * num_heads + head
    m = tl.load(part_ml_ptr + w_row, mask=s_mask, other=float("-inf"))
    lsum = tl.load(part_ml_ptr + NUM_SPLITS * num_tiles * num_heads + w_row, mask=s_mask,
                   other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    denom = tl.sum(w * lsum, 0)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(part_acc_ptr + w_row[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                  mask=s_mask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _CPU_SM_COUNT


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _head_dim_pad(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def tile_config(block_m: int, head_dim_pad: int, dtype: torch.dtype) -> dict[str, int]:
    """Launch constants of a tile of ``block_m`` rows (no autotune). Compiled for sm_90 with
    ptxas at head_dim 64/128/256 and G 1/4/7/32: no 16-bit config spills registers.

    16-bit: the whole tile in one pass (at most 128 rows), key tiles of 64 positions (32
    past head_dim 128), 8 warps for 128-row tiles, else 4; one pipeline stage past head_dim
    128 to bound shared memory. float32 (exact FMA dots, whose operands live in registers):
    passes of 16 rows, key tiles of 32 (16 past head_dim 128), 8 warps.
    """
    if dtype == torch.float32:
        return dict(PASS_M=16, BLOCK_N=32 if head_dim_pad <= 128 else 16,
                    num_warps=8, num_stages=2)
    pass_m = min(block_m, 128)
    return dict(PASS_M=pass_m, BLOCK_N=64 if head_dim_pad <= 128 else 32,
                num_warps=8 if pass_m >= 128 else 4, num_stages=2 if head_dim_pad <= 128 else 1)


def decode_splits(num_decode_tiles: int, num_kv_heads: int, max_keys: int, block_n: int,
                  device: torch.device) -> int:
    """Key-range splits of the decode launch: enough programs for about two per SM, never
    more than the key tiles of the longest possible context nor ``MAX_SPLITS``; 1 once
    ``num_decode_tiles × num_kv_heads`` fills the SMs. Host ints only (CUDA-graph stable)."""
    programs = num_decode_tiles * num_kv_heads
    sms = _sm_count(device)
    if programs == 0 or programs >= sms:
        return 1
    key_tiles = cdiv(max(max_keys, 1), block_n)
    splits = max(1, min(cdiv(2 * sms, programs), key_tiles, MAX_SPLITS))
    # A power of two: NUM_SPLITS is compiled in, so few values mean few compilations.
    return 1 << (splits.bit_length() - 1)


def decode_block_m(num_queries_per_kv: int) -> int:
    """Rows of a decode tile: the G query heads of one KV head, padded to a power of two
    ≥ 16 (``tl.dot``'s minimum)."""
    return max(16, next_power_of_2(num_queries_per_kv))


def decode_max_keys(table_width: int, block_size: int, sliding_window: int | None,
                    block_n: int) -> int:
    """Key positions a decode sequence may attend to, for the split heuristic: the block
    table's width in tokens, at most the window plus one key tile."""
    max_keys = table_width * block_size
    return max_keys if sliding_window is None else min(max_keys, sliding_window + block_n)


def decode_split_choices(num_queries_per_kv: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype, block_size: int, max_blocks_per_seq: int,
                         max_num_seqs: int, sliding_window: int | None,
                         device: torch.device) -> list[int]:
    """Every ``NUM_SPLITS`` that ``paged_attention_triton`` can pick for its decode launch
    (ascending), over 1..``max_num_seqs`` decode sequences and block tables 1..
    ``max_blocks_per_seq`` wide: each is a compiled specialization of the decode kernel
    (and, past 1, of the combine kernel). Host ints only."""
    block_n = tile_config(decode_block_m(num_queries_per_kv), _head_dim_pad(head_dim),
                          dtype)["BLOCK_N"]
    # Past one program per SM the heuristic answers 1; more sequences change nothing.
    most = min(max_num_seqs, cdiv(_sm_count(device), num_kv_heads))
    # decode_splits sees the keys only as key tiles, capped at MAX_SPLITS: one table width
    # per capped tile count stands for all.
    keys: dict[int, int] = {}
    for width in range(1, max_blocks_per_seq + 1):
        k = decode_max_keys(width, block_size, sliding_window, block_n)
        keys.setdefault(min(cdiv(k, block_n), MAX_SPLITS), k)
    return sorted({decode_splits(n, num_kv_heads, k, block_n, device)
                   for n in range(1, most + 1) for k in keys.values()})


@functools.cache
def _dummy_scale(device: torch.device) -> torch.Tensor:
    """A float32 stand-in for the scale pointers of an unquantized launch (never read)."""
    return torch.zeros(1, dtype=torch.float32, device=device)


def _scale_args(kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(k_scale, v_scale, stride_sb, stride_ss)``: the scale planes of a quantized cache,
    or the float32 dummy and zero strides."""
    if kv_cache.quantized:
        k_scale, v_scale = kv_cache.scale[0], kv_cache.scale[1]
        return k_scale, v_scale, k_scale.stride(0), k_scale.stride(1)
    dummy = _dummy_scale(kv_cache.data.device)
    return dummy, dummy, 0, 0


def _check_contiguous(kv_cache: KVCache) -> None:
    if not kv_cache.data.is_contiguous() or (
            kv_cache.quantized and not kv_cache.scale.is_contiguous()):
        raise ValueError("kv_cache.data and kv_cache.scale must be contiguous")


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                    cache_loc: torch.Tensor) -> None:
    """``data[:, loc // bs, loc % bs] = (k, v)`` for every row with ``cache_loc`` ≥ 0; a quantized
    cache stores ``code = round(x / scale)`` and ``scale = max_d |x[d]| / QMAX`` per (row,
    KV head) instead (``manylora.ops.paged_kv.quantize_kv``, bit-exact for int8).

    One program per token row, no host sync (CUDA-graph safe).

    Args:
        k, v: ``[T, num_kv_heads, head_dim]`` (any strides; copied when the last dim is not
            contiguous): the cache's dtype when unquantized, float32 / bfloat16 / float16
            when quantized.
        kv_cache: a ``KVCache`` with contiguous ``data [2, num_blocks, block_size,
            num_kv_heads, head_dim]`` and, when quantized, contiguous float32 ``scale [2,
            num_blocks, block_size, num_kv_heads]``.
        cache_loc: int64 ``[T]``; -1 rows write nothing.

    Raises:
        ValueError: shapes, dtypes or a cache layout that do not match.
    """
    check_kv_cache(kv_cache)
    data = kv_cache.data
    num_tokens, num_kv_heads, head_dim = k.shape
    if (v.shape != k.shape or data.shape[3:] != k.shape[1:]
            or cache_loc.shape != (num_tokens,)):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}, cache_loc "
                         f"{tuple(cache_loc.shape)} do not fit kv_cache {tuple(data.shape)}")
    if kv_cache.quantized:
        if not (k.is_floating_point() and v.is_floating_point()):
            raise ValueError(f"k/v must be floating point to quantize, got {k.dtype}/{v.dtype}")
    elif k.dtype != data.dtype or v.dtype != data.dtype:
        raise ValueError(f"k/v dtype {k.dtype}/{v.dtype} differs from the cache's {data.dtype}")
    _check_contiguous(kv_cache)
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    cache_loc = cache_loc.contiguous()
    k_cache, v_cache = data[0], data[1]
    k_scale, v_scale, stride_sb, stride_ss = _scale_args(kv_cache)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, k_scale, v_scale, cache_loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_sb, stride_ss,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=next_power_of_2(head_dim), BLOCK_SIZE=data.shape[2],
        QUANT=kv_cache.quantized, QMAX=KV_QUANT_MAX.get(data.dtype, 0.0))


def paged_attention_triton(q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                           scale: float, sliding_window: int | None = None, *,
                           num_splits: int | None = None, out: torch.Tensor | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Paged attention of the module formula: one launch over the decode tiles (split over
    the key range when few), one over the prefill tiles. No host sync; CUDA-graph safe. A
    quantized cache is dequantized in registers (codes × per-position scales); the softmax
    and the accumulation stay float32.

    Args:
        q: ``[T, num_heads, head_dim]`` (float32, bfloat16 or float16), any strides.
        kv_cache: a ``KVCache`` with contiguous ``data [2, num_blocks, block_size,
            num_kv_heads, head_dim]`` in q's dtype, or int8 / float8_e4m3fn with contiguous
            float32 ``scale [2, num_blocks, block_size, num_kv_heads]``.
        meta: the step's ``AttentionMetadata`` (same device).
        scale: softmax scale.
        sliding_window: window in positions (≥ 1) or None.
        num_splits: key-range splits of the decode launch; None picks ``decode_splits``.
        out: optional ``[T, num_heads, head_dim]`` buffer of q's dtype (last dim contiguous)
            to write into instead of a new one.
        softcap: the logits' soft cap (> 0; Gemma 2's ``attn_logit_softcapping``), or None /
            0 for none (compiled out).

    Returns:
        ``[T, num_heads * head_dim]`` in q's dtype (a view of ``out`` when given); every
        element written (zeros for padding rows).

    Raises:
        ValueError: shapes, dtypes, layouts, window, ``num_splits`` or ``softcap`` out of
            range.
    """
    check_attention_inputs(q, kv_cache, meta)
    check_softcap(softcap)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be ≥ 1 or None, got {sliding_window}")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    _check_contiguous(kv_cache)
    q = _last_dim_contiguous(q)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.data.shape[3], kv_cache.data.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim, "
                         f"got {tuple(out.shape)} {out.dtype}")
    num_decode = meta.num_decode_tiles
    num_prefill = meta.tile_seq.shape[0] - num_decode
    head_dim_pad = _head_dim_pad(head_dim)
    k_cache, v_cache = kv_cache.data[0], kv_cache.data[1]
    k_scale, v_scale, stride_sb, stride_ss = _scale_args(kv_cache)
    # Triton's interpreter multiplies bfloat16 dot operands as raw integers: on CPU the
    # operands are widened to float32 first (same products; p still rounded to bfloat16).
    upcast = q.dtype == torch.bfloat16 and not q.is_cuda
    common = dict(
        qk_scale=scale / softcap if softcap else scale * _LOG2E,
        softcap=softcap * _LOG2E if softcap else 0.0,
        window=sliding_window or 0, num_heads=num_heads,
        stride_qt=q.stride(0), stride_qh=q.stride(1),
        stride_ot=out.stride(0), stride_oh=out.stride(1),
        stride_cb=k_cache.stride(0), stride_cs=k_cache.stride(1), stride_ch=k_cache.stride(2),
        stride_bt=meta.block_tables.stride(0), stride_sb=stride_sb, stride_ss=stride_ss,
        G=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        USE_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        UPCAST_DOT=upcast, QUANT=kv_cache.quantized, SOFTCAP=bool(softcap))
    tensors = (meta.block_tables, meta.query_start, meta.query_lens, meta.context_lens)

    if num_decode:
        block_m = decode_block_m(group)
        config = tile_config(block_m, head_dim_pad, q.dtype)
        splits = num_splits or decode_splits(
            num_decode, num_kv_heads, decode_max_keys(meta.block_tables.shape[1], block_size,
                                                      sliding_window, config["BLOCK_N"]),
            config["BLOCK_N"], q.device)
        if splits > 1:
            part_acc = torch.empty(splits, num_decode, num_heads, head_dim_pad,
                                   dtype=torch.float32, device=q.device)
            part_ml = torch.empty(2, splits, num_decode, num_heads, dtype=torch.float32,
                                  device=q.device)
        else:
            part_acc = part_ml = out
        tile_seq = meta.tile_seq[:num_decode]
        _paged_attention_kernel[(num_decode, num_kv_heads, splits)](
            out, q, k_cache, v_cache, k_scale, v_scale, *tensors, tile_seq,
            meta.tile_query[:num_decode],
            part_acc, part_ml, num_tiles=num_decode, BLOCK_Q=1, BLOCK_M=block_m,
            NUM_SPLITS=splits, **config, **common)
        if splits > 1:
            _combine_splits_kernel[(num_decode, num_heads)](
                out, part_acc, part_ml, tile_seq, meta.query_start, num_decode, num_heads,
                out.stride(0), out.stride(1), NUM_SPLITS=splits,
                SPLITS_PAD=next_power_of_2(splits), HEAD_DIM=head_dim,
                HEAD_DIM_PAD=head_dim_pad, num_warps=4)
    if num_prefill:
        block_q = meta.prefill_block_q
        block_m = max(16, next_power_of_2(block_q * group))
        _paged_attention_kernel[(num_prefill, num_kv_heads, 1)](
            out, q, k_cache, v_cache, k_scale, v_scale, *tensors, meta.tile_seq[num_decode:],
            meta.tile_query[num_decode:], out, out, num_tiles=num_prefill, BLOCK_Q=block_q,
            BLOCK_M=block_m, NUM_SPLITS=1, **tile_config(block_m, head_dim_pad, q.dtype),
            **common)
    return out.reshape(num_tokens, num_heads * head_dim)
