"""Triton kernel: an FP8 W8A8 projection over few rows (decode), bound by reading the e4m3fn
weight.

The skinny GEMM of ``manylora.ops.triton_skinny`` with FP8 operands: one program owns
``BLOCK_N`` output columns for all ``M ≤ BLOCK_M`` rows and walks its range of ``K`` (K
split over programs where the column tiles alone would leave the GPU idle, reduced in the
same launch by ``manylora.ops.split_k``) through a software pipeline, ``tl.dot`` on e4m3fn
tiles (FP8 tensor cores, compute capability ≥ 8.9), then one rounding. Per-row scales chain
the products in the tensor cores' accumulator (on Hopper it keeps about 14 mantissa bits
while it sums FP8 products, as cuBLASLt's fast-accumulation FP8 GEMMs do); block scales add
each K block's product into a float32 accumulator on the CUDA cores (DeepSeek-V3's
promotion). With per-token activation scales ``sx [M, 1]`` and per-row weight scales
``sw [N]`` (vLLM's ``Fp8LinearMethod`` per-channel / per-tensor)::

    y[m, n] = sx[m] · sw[n] · Σ_k xq[m, k] · wq[n, k]   (+ b[n])

and with per-(token, ``BLOCK_K``-group) activation scales ``sx [M, KB]`` and per-(row,
K-block) weight scales ``sw [N, KB]`` (block-wise FP8, DeepSeek-V3's 128 x 128; vLLM's
``w8a8_block_fp8_matmul``), each K block's partial product rescaled before it is added::

    y[m, n] = Σ_kb sx[m, kb] · sw[n, kb] · Σ_{k in kb} xq[m, k] · wq[n, k]   (+ b[n])

These are ``fp8_kernels.scaled_mm``'s and ``fp8_kernels.block_matmul``'s products; for few
rows cuBLASLt's FP8 kernels and the tiled block kernel leave most of the GPU idle. No host
synchronisation: CUDA-graph capturable. Runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from manylora.ops.quant.fp8_kernels import FP8_MAX, MIN_SCALE, fp8_gpu
from manylora.ops.split_k import split_count, split_workspace, store_split
from manylora.ops.triton_skinny import row_bucket

#: Rows up to which ``fp8_skinny_eligible`` holds.
FP8_SKINNY_MAX_ROWS = 64
#: ``BLOCK_M`` → ``(BLOCK_N, BLOCK_K, num_warps, num_stages, programs per SM)`` for per-row
#: scales, and ``BLOCK_M`` → ``(BLOCK_N, num_warps, num_stages, programs per SM)`` for block
#: scales (``BLOCK_K`` is the scale block). K is split over programs until about ``programs
#: per SM`` run on each streaming multiprocessor (0: no split). Measured by
#: ``benchmarks/bench_quant_kernels.py``.
ROW_SCALE_CONFIGS = {
    16: (32, 512, 4, 4, 0),
    32: (32, 256, 4, 4, 4),
    64: (64, 256, 4, 4, 0),
}
BLOCK_SCALE_CONFIGS = {
    16: (32, 4, 4, 4),
    32: (32, 4, 4, 4),
    64: (32, 4, 4, 4),
}


@triton.jit
def _quantize_tile(x, scale, QMAX: tl.constexpr):
    """``e4m3(clamp(x / s, -QMAX, QMAX))`` of a float32 tile by per-row scales ``s [BM]``
    (``fp8_act_quant``'s formula)."""
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -QMAX), QMAX)
    return v.to(tl.float8e4nv)


@triton.jit
def _amax_scale(amax, QMAX: tl.constexpr, SMIN: tl.constexpr):
    """``max(a / QMAX, SMIN)`` per row of ``amax [BM, B]`` (``fp8_act_quant``'s scale)."""
    return tl.maximum(tl.math.div_rn(tl.max(amax, axis=1), QMAX), SMIN)


@triton.jit(do_not_specialize=["M", "STEPS_PER_SPLIT"])
def _fp8_skinny_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, ws_ptr, count_ptr, y_ptr, M, N, K,
                       STEPS_PER_SPLIT, stride_xm, stride_wn, stride_ym, stride_sxm, stride_swn,
                       X_QUANT: tl.constexpr, BLOCK_SCALES: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QMAX: tl.constexpr,
                       SMIN: tl.constexpr):
    # X_QUANT 0: x is e4m3 with its scales in sx; else x is 16/32-bit, quantized here by
    # 1: per-row scales from the row's absolute maximum, 2: one scale per row and K block
    # (BLOCK_SCALES), 3: the static scale sx[0]
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if SPLIT:   # a split starts on a multiple of BLOCK_K the compiler can see (16-byte loads)
        k_start = tl.program_id(1) * STEPS_PER_SPLIT * BLOCK_K
        k_stop = tl.minimum(k_start + STEPS_PER_SPLIT * BLOCK_K, K)
    else:
        k_start = 0
        k_stop = K
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    if X_QUANT == 1:    # the rows' scales over all of K, before this split's range
        amax = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            v = tl.load(x_ptrs + k0, mask=m_mask[:, None] & (offs_k[None, :] + k0 < K),
                        other=0.0)
            amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
        sx_rows = _amax_scale(amax, QMAX, SMIN)
    elif X_QUANT == 3:
        sx_rows = tl.load(sx_ptr + offs_m * 0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        k_mask = offs_k + k0 < K              # only K cuts a tile: splits are whole steps
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if X_QUANT == 2:
            xf = x.to(tl.float32)
            sx = _amax_scale(tl.abs(xf), QMAX, SMIN)
            x = _quantize_tile(xf, sx, QMAX)
        elif X_QUANT != 0:
            x = _quantize_tile(x.to(tl.float32), sx_rows, QMAX)
        if BLOCK_SCALES:
            kb = k0 // BLOCK_K
            if X_QUANT == 0:
                sx = tl.load(sx_ptr + offs_m * stride_sxm + kb, mask=m_mask, other=0.0)
            sw = tl.load(sw_ptr + offs_n * stride_swn + kb, mask=n_mask, other=0.0)
            acc += tl.dot(x, tl.trans(w)) * sx[:, None] * sw[None, :]
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if not BLOCK_SCALES:
        if X_QUANT == 0:
            sx_rows = tl.load(sx_ptr + offs_m * stride_sxm, mask=m_mask, other=0.0)
        sw = tl.load(sw_ptr + offs_n * stride_swn, mask=n_mask, other=0.0)
        acc = acc * sx_rows[:, None] * sw[None, :]
    store_split(acc, ws_ptr, count_ptr, b_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, pid,
                HAS_BIAS, SPLIT)


def fp8_skinny_config(rows: int, block_k: int | None) -> tuple[int, int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, programs per SM)`` for ``rows``
    rows (1 ≤ rows ≤ ``FP8_SKINNY_MAX_ROWS``) with per-row scales (``block_k`` None) or K
    blocks of ``block_k``."""
    block_m = row_bucket(rows)
    if block_k is None:
        return (block_m, *ROW_SCALE_CONFIGS[block_m])
    block_n, warps, stages, per_sm = BLOCK_SCALE_CONFIGS[block_m]
    return block_m, block_n, block_k, warps, stages, per_sm


def fp8_skinny_eligible(x: torch.Tensor, n: int, k: int, block_k: int | None) -> bool:
    """Whether ``fp8_skinny_linear`` serves ``x`` by an ``[n, k]`` weight: a CUDA device with
    FP8 tensor cores, 1 to ``FP8_SKINNY_MAX_ROWS`` rows with unit column stride, and a K
    block (block scales) that is a power of two from 32 (FP8 ``tl.dot``'s K) to 256."""
    if not (fp8_gpu(x) and x.dim() == 2 and 1 <= x.shape[0] <= FP8_SKINNY_MAX_ROWS
            and x.stride(1) == 1):
        return False
    return block_k is None or (32 <= block_k <= 256 and block_k & (block_k - 1) == 0)


def fp8_skinny_linear(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                      out_dtype: torch.dtype, block_k: int | None = None,
                      bias: torch.Tensor | None = None,
                      config: tuple[int, int, int, int, int, int] | None = None,
                      splits: int | None = None) -> torch.Tensor:
    """The W8A8 product of the module docstring → ``[M, N]`` in ``out_dtype``.

    Args:
        xq: ``[M, K]`` e4m3fn, unit column stride, 1 ≤ M ≤ ``FP8_SKINNY_MAX_ROWS``.
        sx: float32 ``[M, 1]`` (per-row scales) or ``[M, ceil(K / block_k)]``.
        wq: ``[N, K]`` e4m3fn, contiguous.
        sw: float32 ``[N]`` or ``[N, ceil(K / block_k)]``.
        out_dtype: the result's dtype.
        block_k: the K block of block scales, or None for per-row scales.
        bias: ``[N]`` or None, added before the rounding.
        config: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, programs per SM)``;
            None: ``fp8_skinny_config`` (with block scales ``BLOCK_K`` must be
            ``block_k``). K is split (``split_k.split_count``) so that about ``programs
            per SM`` programs run per streaming multiprocessor; 0 does not split.
        splits: the K split itself (None: from the config), each a whole number of
            ``BLOCK_K`` steps.

    Raises:
        ValueError: shapes, dtypes or layouts that do not fit together.
    """
    m, k = xq.shape
    groups = 1 if block_k is None else triton.cdiv(k, block_k)
    if xq.dtype != torch.float8_e4m3fn or tuple(sx.shape) != (m, groups):
        raise ValueError(f"fp8_skinny_linear: xq {tuple(xq.shape)} {xq.dtype}, sx "
                         f"{tuple(sx.shape)}, block_k {block_k}")
    return _launch(xq, sx.float(), 0, wq, sw, out_dtype, block_k, bias, config, splits)


def fp8_skinny_quantizing_linear(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                                 block_k: int | None = None, bias: torch.Tensor | None = None,
                                 static_scale: torch.Tensor | None = None,
                                 config: tuple[int, int, int, int, int, int] | None = None,
                                 splits: int | None = None) -> torch.Tensor:
    """``fp8_skinny_linear(*quantize_activations(x, block_k or scale), ...)`` in one launch:
    the kernel quantizes the 16/32-bit rows itself by ``fp8_act_quant``'s formula (per row,
    per row and K block with block scales, or by a static scale), the same codes and scales,
    and the same product.

    Args:
        x: ``[M, K]`` float32 / bfloat16 / float16, unit column stride, 1 ≤ M ≤
            ``FP8_SKINNY_MAX_ROWS``; the result is in x's dtype.
        static_scale: a per-tensor scale (0-d or ``[1]`` float32), or None: dynamic scales
            (per row, or per row and K block with ``block_k``). Not with ``block_k``.
        wq, sw, block_k, bias, config, splits: as ``fp8_skinny_linear``.

    Raises:
        ValueError: a static scale with block scales, or as ``fp8_skinny_linear``.
    """
    if static_scale is not None and block_k is not None:
        raise ValueError("fp8_skinny_quantizing_linear: a static scale with block scales")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_skinny_quantizing_linear: x is {x.dtype}")
    mode = 3 if static_scale is not None else (2 if block_k is not None else 1)
    sx = x if static_scale is None else static_scale.reshape(1).float()
    return _launch(x, sx, mode, wq, sw, x.dtype, block_k, bias, config, splits)


def _launch(x, sx, mode, wq, sw, out_dtype, block_k, bias, config, splits) -> torch.Tensor:
    m, k = x.shape
    n = wq.shape[0]
    if not 1 <= m <= FP8_SKINNY_MAX_ROWS:
        raise ValueError(f"fp8_skinny_linear: {m} rows, 1 to {FP8_SKINNY_MAX_ROWS}")
    config = config or fp8_skinny_config(m, block_k)
    block_m, block_n, tile_k, warps, stages, per_sm = config
    groups = 1 if block_k is None else triton.cdiv(k, block_k)
    if (wq.dtype != torch.float8_e4m3fn or not 1 <= m <= block_m or wq.shape[1] != k
            or x.stride(1) != 1 or not wq.is_contiguous() or sw.shape[0] != n
            or (block_k is not None and tile_k != block_k)
            or (block_k is not None and tuple(sw.shape) != (n, groups))
            or (bias is not None and tuple(bias.shape) != (n,))):
        raise ValueError(f"fp8_skinny_linear: x {tuple(x.shape)} {x.dtype}, wq "
                         f"{tuple(wq.shape)} {wq.dtype}, sw {tuple(sw.shape)}, block_k "
                         f"{block_k}, config {config}")
    sw = sw.float().contiguous()
    tiles, steps = triton.cdiv(n, block_n), triton.cdiv(k, tile_k)
    if splits is None:
        splits = split_count(tiles, steps, per_sm, x.device) if per_sm else 1
    per_split = triton.cdiv(steps, splits)
    splits = triton.cdiv(steps, per_split)
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    ws, counters = split_workspace(splits, m, n, y)
    _fp8_skinny_kernel[(tiles, splits)](
        x, sx, wq, sw, wq if bias is None else bias, ws, counters, y, m, n, k, per_split,
        x.stride(0), wq.stride(0), y.stride(0), sx.stride(0) if sx.dim() == 2 else 0,
        sw.stride(0) if sw.dim() == 2 else 1, X_QUANT=mode, BLOCK_SCALES=block_k is not None,
        HAS_BIAS=bias is not None, SPLIT=splits > 1, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=tile_k, QMAX=FP8_MAX, SMIN=MIN_SCALE, num_warps=warps, num_stages=stages)
    return y
