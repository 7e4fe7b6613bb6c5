"""Triton kernel: a projection over few rows, ``y = x Wᵀ (+ b)``, bound by reading ``W``.

A decode step multiplies at most a few dozen rows by every weight of the model, so each
projection costs the bytes of ``W [N, K]``. One program owns ``BLOCK_N`` output columns for
all ``M`` rows (padded to ``BLOCK_M`` ≥ 16, ``tl.dot``'s minimum) and walks ``K`` in steps
of ``BLOCK_K`` through a deep software pipeline, so enough of ``W`` is in flight to keep the
memory busy (the split-free skinny GEMM of Triton's and FlashInfer's decode GEMMs)::

    y[m, n] = Σ_k x[m, k] · W[n, k]  (+ b[n]),    float32 accumulation, one rounding

The dense linear method (``manylora.ops.linear_method.UnquantizedLinearMethod``) uses it
inside CUDA-graph capture for CUDA ``bfloat16``/``float16`` inputs of at most
``SKINNY_MAX_ROWS`` rows where ``SKINNY_CONFIGS`` (measured on an H100, sm_90, per row
bucket and weight shape by ``benchmarks/bench_skinny_gemm.py``) found it faster than
cuBLAS, and ``torch.nn.functional.linear`` (cuBLAS) otherwise. No host synchronisation:
CUDA-graph safe. Under ``TRITON_INTERPRET=1`` (CPU tensors) 16-bit operands are widened to
float32 before the dot (the interpreter multiplies bfloat16 bit patterns as integers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Rows up to which the dense linear method runs the skinny kernel on CUDA.
SKINNY_MAX_ROWS = 64
#: Row buckets (``BLOCK_M``): a launch of ``M`` rows uses the smallest bucket ≥ M.
ROW_BUCKETS = (16, 32, 64)
#: ``(BLOCK_M, N, K) → (BLOCK_N, BLOCK_K, num_warps, num_stages)``, or None where cuBLAS
#: was faster, measured on an H100 (``benchmarks/bench_skinny_gemm.py``); shapes it lacks
#: run on cuBLAS.
SKINNY_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int] | None] = {
    # Llama-3-8B (and Mistral-7B's attention and MLP shapes): q/k/v, o, gate/up, down, head
    (16, 6144, 4096): (64, 256, 4, 4),
    (16, 4096, 4096): (32, 128, 4, 6),
    (16, 28672, 4096): (128, 256, 4, 3),
    (16, 4096, 14336): (32, 256, 4, 6),
    (16, 128256, 4096): (64, 512, 4, 3),
    (32, 6144, 4096): (64, 128, 4, 6),
    (32, 4096, 4096): None,
    (32, 28672, 4096): (128, 128, 4, 4),
    (32, 4096, 14336): (32, 512, 4, 3),
    (32, 128256, 4096): (128, 128, 4, 4),
    (64, 6144, 4096): (64, 256, 4, 3),
    (64, 4096, 4096): None,
    (64, 28672, 4096): (128, 128, 4, 4),
    (64, 4096, 14336): (32, 256, 4, 4),
    (64, 128256, 4096): (128, 128, 4, 3),
}


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_mask = offs_m[:, None] < M
    col_mask = offs_n[:, None] < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs + k0, mask=row_mask, other=0.0)
        w = tl.load(w_ptrs + k0, mask=col_mask, other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask & (offs_n[None, :] < N))


def row_bucket(rows: int) -> int:
    """``BLOCK_M`` for ``rows`` rows (1 ≤ rows ≤ ``SKINNY_MAX_ROWS``)."""
    return next(b for b in ROW_BUCKETS if b >= rows)


def skinny_config(rows: int, n: int, k: int) -> tuple[int, int, int, int, int] | None:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` for ``rows × k`` by ``[n, k]``
    from ``SKINNY_CONFIGS``; None: run it on cuBLAS (measured faster, or not measured)."""
    block_m = row_bucket(rows)
    config = SKINNY_CONFIGS.get((block_m, n, k))
    return None if config is None else (block_m, *config)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``y = x Wᵀ (+ b)`` by the skinny kernel (module formula).

    Args:
        x: ``[M, K]``, 1 ≤ M ≤ ``SKINNY_MAX_ROWS``, last dimension contiguous.
        weight: ``[N, K]`` contiguous, x's dtype and device.
        bias: ``[N]`` or None.
        config: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``; None:
            ``skinny_config`` (which must have one).

    Returns:
        ``[M, N]`` in x's dtype.

    Raises:
        ValueError: shapes, dtypes, layouts or a ``BLOCK_K`` that does not divide ``K``.
    """
    m, k = x.shape
    n = weight.shape[0]
    config = config or skinny_config(m, n, k)
    if config is None:
        raise ValueError(f"skinny_linear: no launch config for {m} rows of [{n}, {k}]")
    block_m, block_n, block_k, warps, stages = config
    if not 1 <= m <= block_m or weight.shape[1] != k or x.stride(1) != 1 \
            or not weight.is_contiguous() or weight.dtype != x.dtype or k % block_k:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} {x.dtype} (strides "
                         f"{x.stride()}), weight {tuple(weight.shape)} {weight.dtype}, "
                         f"BLOCK_M {block_m}, BLOCK_K {block_k}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"skinny_linear: bias {tuple(bias.shape)}, expected ({n},)")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    dot_fp32 = x.device.type != "cuda" and x.dtype != torch.float32
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight if bias is None else bias, y, m, n, k, x.stride(0),
        weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, DOT_FP32=dot_fp32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        num_stages=stages)
    return y


def skinny_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the skinny kernel has a measured config that beats cuBLAS for these operands
    (CUDA, 16-bit, at most ``SKINNY_MAX_ROWS`` rows, a ``BLOCK_K`` dividing ``K``)."""
    if not (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= SKINNY_MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.stride(1) == 1 and weight.is_contiguous()):
        return False
    config = skinny_config(x.shape[0], *weight.shape)
    return config is not None and weight.shape[1] % config[2] == 0

