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

from manylora.ops.quant.fp8_kernels import fp8_gpu
from manylora.ops.split_k import (
    split_count,
    split_workspace,
    store_split,
    whole_step_splits,
)
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


@triton.jit(do_not_specialize=["M", "STEPS_PER_SPLIT"])
def _fp8_skinny_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, ws_ptr, count_ptr, y_ptr, M, N, K,
                       STEPS_PER_SPLIT, stride_xm, stride_wn, stride_ym, stride_sxm, stride_swn,
                       BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        k_mask = offs_k + k0 < K              # only K cuts a tile: splits are whole steps
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if BLOCK_SCALES:
            kb = k0 // BLOCK_K
            sx = tl.load(sx_ptr + offs_m * stride_sxm + kb, mask=m_mask, other=0.0)
            sw = tl.load(sw_ptr + offs_n * stride_swn + kb, mask=n_mask, other=0.0)
            acc += tl.dot(x, tl.trans(w)) * sx[:, None] * sw[None, :]
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if not BLOCK_SCALES:
        sx = tl.load(sx_ptr + offs_m * stride_sxm, mask=m_mask, other=0.0)
        sw = tl.load(sw_ptr + offs_n * stride_swn, mask=n_mask, other=0.0)
        acc = acc * sx[:, None] * sw[None, :]
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
        splits: the K split itself (None: from the config), each split ``ceil(K / splits)``
            columns rounded up to ``BLOCK_K``.

    Raises:
        ValueError: shapes, dtypes or layouts that do not fit together.
    """
    m, k = xq.shape
    n = wq.shape[0]
    if not 1 <= m <= FP8_SKINNY_MAX_ROWS:
        raise ValueError(f"fp8_skinny_linear: {m} rows, 1 to {FP8_SKINNY_MAX_ROWS}")
    config = config or fp8_skinny_config(m, block_k)
    block_m, block_n, tile_k, warps, stages, per_sm = config
    groups = 1 if block_k is None else triton.cdiv(k, block_k)
    if (xq.dtype != torch.float8_e4m3fn or wq.dtype != torch.float8_e4m3fn
            or not 1 <= m <= block_m or wq.shape[1] != k or xq.stride(1) != 1
            or not wq.is_contiguous() or tuple(sx.shape) != (m, groups)
            or sw.shape[0] != n or (block_k is not None and tile_k != block_k)
            or (block_k is not None and tuple(sw.shape) != (n, groups))
            or (bias is not None and tuple(bias.shape) != (n,))):
        raise ValueError(f"fp8_skinny_linear: xq {tuple(xq.shape)} {xq.dtype}, sx "
                         f"{tuple(sx.shape)}, wq {tuple(wq.shape)} {wq.dtype}, sw "
                         f"{tuple(sw.shape)}, block_k {block_k}, config {config}")
    sx, sw = sx.float(), sw.float().contiguous()
    tiles, steps = triton.cdiv(n, block_n), triton.cdiv(k, tile_k)
    if splits is None:
        splits = split_count(tiles, steps, per_sm, xq.device) if per_sm else 1
    per_split, splits = whole_step_splits(steps, splits)
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    ws, counters = split_workspace(splits, m, n, y)
    _fp8_skinny_kernel[(tiles, splits)](
        xq, sx, wq, sw, wq if bias is None else bias, ws, counters, y, m, n, k, per_split,
        xq.stride(0), wq.stride(0), y.stride(0), sx.stride(0),
        sw.stride(0) if sw.dim() == 2 else 1, BLOCK_SCALES=block_k is not None,
        HAS_BIAS=bias is not None, SPLIT=splits > 1, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=tile_k, num_warps=warps, num_stages=stages)
    return y
