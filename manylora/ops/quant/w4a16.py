"""Triton kernels: a projection by INT4 weights with 16/32-bit activations (W4A16), and the
torch reference that dequantizes.

Every INT4 format (GPTQ, AWQ, compressed-tensors ``pack-quantized``) is repacked once at
load into one layout, which these kernels read:

* ``qweight`` int32 ``[ceil(K/8), N]``: nibble ``j`` (bits ``4j .. 4j+3``) of word ``i``
  holds the unsigned code ``q[8i + j, n]`` in ``0 .. 15`` (GPTQ's ``qweight`` packing);
* ``scales`` ``[G, N]`` and ``zeros`` ``[G, N]`` in the activation dtype: the scale and the
  (unsigned, real) zero point of each group of input rows;
* the group of input row ``k``: ``g(k) = k // group_size``, or ``g_idx[k]`` (int32 ``[K]``)
  where the groups are not contiguous runs of ``group_size`` rows.

The product, float32 accumulation, rounded once to x's dtype::

    y[t, n] = Σ_k x[t, k] · s[g(k), n] · (q[k, n] − z[g(k), n])   (+ b[n])

Two kernels: ``w4a16_gemm`` (prefill: ``BLOCK_M × BLOCK_N`` output tiles, the weight tile
dequantized in the K loop and multiplied by ``tl.dot``) and ``w4a16_gemv`` (decode, at most
``DECODE_MAX_ROWS`` rows: one ``tl.dot`` tile of 16 rows covers them all, and K is split over
``SPLIT_K`` programs per column block so that a skinny product still fills the GPU; the
partial sums go to a float32 workspace summed in torch, deterministic, without atomics).
``w4a16_linear`` picks between them by the row count. Neither synchronises with the host:
CUDA-graph safe. Under ``TRITON_INTERPRET=1`` (CPU tensors) the dot runs in float32 (the
interpreter multiplies bfloat16 bit patterns as integers).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

#: Rows up to which ``w4a16_linear`` runs the split-K GEMV kernel (its one ``tl.dot`` tile
#: of 16 rows, ``tl.dot``'s minimum, covers them); more rows run the GEMM kernel.
DECODE_MAX_ROWS = 16
#: The GEMM kernel's ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``.
GEMM_CONFIG = (64, 64, 64, 4, 3)
#: The GEMV kernel's ``(BLOCK_N, BLOCK_K, num_warps, num_stages)``.
GEMV_CONFIG = (64, 128, 4, 3)
#: Split-K programs aimed at per streaming multiprocessor in the GEMV kernel.
_PROGRAMS_PER_SM = 4


@triton.jit
def _dequant_tile(q_ptr, s_ptr, z_ptr, g_ptr, k0, offs_n, N, K, GROUP_SIZE: tl.constexpr,
                  HAS_GIDX: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile ``W[k0 : k0 + BLOCK_K, offs_n] = s · (q − z)`` in float32 (zero
    outside K/N). Where whole tiles lie in one group (``k0`` a multiple of ``BLOCK_K``,
    which divides ``GROUP_SIZE``) one row of scales and zeros serves the tile."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    n_mask = offs_n < N
    mask = k_mask[:, None] & n_mask[None, :]
    words = tl.load(q_ptr + (offs_k // 8)[:, None] * N + offs_n[None, :], mask=mask, other=0)
    q = ((words >> ((offs_k % 8) * 4)[:, None]) & 0xF).to(tl.float32)
    if HAS_GIDX:
        g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)
        gn = g[:, None] * N + offs_n[None, :]
        s = tl.load(s_ptr + gn, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + gn, mask=mask, other=0.0).to(tl.float32)
    elif GROUP_SIZE % BLOCK_K == 0:
        gn = (k0 // GROUP_SIZE) * N + offs_n
        s = tl.load(s_ptr + gn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        z = tl.load(z_ptr + gn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    else:
        gn = (offs_k // GROUP_SIZE)[:, None] * N + offs_n[None, :]
        s = tl.load(s_ptr + gn, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + gn, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, (q - z) * s, 0.0)


@triton.jit
def _accumulate_tile(acc, x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, k0, k_limit, offs_m, offs_n,
                     row_mask, N, stride_xm, GROUP_SIZE: tl.constexpr, HAS_GIDX: tl.constexpr,
                     DOT_FP32: tl.constexpr, IEEE: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc += x[offs_m, k0 : k0 + BLOCK_K] @ W[k0 : k0 + BLOCK_K, offs_n]`` in float32
    (``W`` from ``_dequant_tile``; columns at or past ``k_limit`` read as zero): the K step
    both kernels share."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=row_mask & (offs_k[None, :] < k_limit), other=0.0)
    w = _dequant_tile(q_ptr, s_ptr, z_ptr, g_ptr, k0, offs_n, N, k_limit, GROUP_SIZE,
                      HAS_GIDX, BLOCK_K)
    if DOT_FP32:
        x = x.to(tl.float32)
    else:
        w = w.to(x.dtype)
    if IEEE:
        return tl.dot(x, w, acc, input_precision="ieee")
    return tl.dot(x, w, acc)


@triton.jit(do_not_specialize=["M"])
def _w4a16_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, y_ptr, M, N, K, stride_xm,
                       stride_ym, GROUP_SIZE: tl.constexpr, HAS_GIDX: tl.constexpr,
                       DOT_FP32: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = _accumulate_tile(acc, x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, k0, K, offs_m, offs_n,
                               row_mask, N, stride_xm, GROUP_SIZE, HAS_GIDX, DOT_FP32, IEEE,
                               BLOCK_K)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=row_mask & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M", "K_PER_SPLIT"])
def _w4a16_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, ws_ptr, M, N, K, K_PER_SPLIT,
                       stride_xm, GROUP_SIZE: tl.constexpr, HAS_GIDX: tl.constexpr,
                       DOT_FP32: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = offs_m[:, None] < M
    k_start = pid_k * K_PER_SPLIT
    k_stop = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        acc = _accumulate_tile(acc, x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, k0, k_stop, offs_m,
                               offs_n, row_mask, N, stride_xm, GROUP_SIZE, HAS_GIDX,
                               DOT_FP32, IEEE, BLOCK_K)
    ws = ws_ptr + pid_k * M * N
    tl.store(ws + offs_m[:, None] * N + offs_n[None, :], acc,
             mask=row_mask & (offs_n[None, :] < N))


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
           zeros: torch.Tensor, g_idx: torch.Tensor | None, group_size: int) -> None:
    m, k = x.shape
    n = qweight.shape[1]
    if (qweight.dtype != torch.int32 or qweight.shape[0] != triton.cdiv(k, 8)
            or scales.shape != zeros.shape or scales.shape[1] != n or x.stride(1) != 1
            or not (qweight.is_contiguous() and scales.is_contiguous()
                    and zeros.is_contiguous())
            or (g_idx is None and (group_size <= 0 or scales.shape[0] < triton.cdiv(k, group_size)))
            or (g_idx is not None and (g_idx.shape != (k,) or g_idx.dtype != torch.int32))):
        raise ValueError(f"w4a16: x {tuple(x.shape)} (strides {x.stride()}), qweight "
                         f"{tuple(qweight.shape)} {qweight.dtype}, scales "
                         f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)}, g_idx "
                         f"{None if g_idx is None else tuple(g_idx.shape)}, group_size "
                         f"{group_size}")


def _flags(x: torch.Tensor) -> dict[str, bool]:
    on_gpu = x.device.type == "cuda"
    return {"DOT_FP32": not on_gpu or x.dtype == torch.float32,
            "IEEE": on_gpu and x.dtype == torch.float32}


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, g_idx: torch.Tensor | None = None,
               group_size: int = 128) -> torch.Tensor:
    """``y = x · dequant(W)`` (module formula) by the tiled GEMM kernel (prefill rows).

    Args:
        x: ``[M, K]`` float32/bfloat16/float16, last dimension contiguous.
        qweight: int32 ``[ceil(K/8), N]`` (module layout).
        scales, zeros: ``[G, N]``, contiguous.
        g_idx: int32 ``[K]``, each row's group, or None: ``k // group_size``.
        group_size: input rows per group (used without ``g_idx``).

    Returns:
        ``[M, N]`` in x's dtype.

    Raises:
        ValueError: shapes, dtypes or layouts that do not fit together.
    """
    _check(x, qweight, scales, zeros, g_idx, group_size)
    m, k = x.shape
    n = qweight.shape[1]
    block_m, block_n, block_k, warps, stages = GEMM_CONFIG
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _w4a16_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, qweight, scales, zeros, qweight if g_idx is None else g_idx, y, m, n, k,
        x.stride(0), y.stride(0), GROUP_SIZE=max(group_size, 1), HAS_GIDX=g_idx is not None,
        **_flags(x), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        num_stages=stages)
    return y


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k(n: int, k: int, device: torch.device) -> int:
    """The GEMV kernel's K split for ``[K, N]``: enough programs for ``_PROGRAMS_PER_SM``
    per streaming multiprocessor (one on CPU), at most one per ``BLOCK_K`` step of K."""
    block_n, block_k = GEMV_CONFIG[:2]
    n_tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    want = triton.cdiv(_PROGRAMS_PER_SM * _sm_count(device), n_tiles)
    return max(1, min(k_tiles, want))


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, g_idx: torch.Tensor | None = None,
               group_size: int = 128, splits: int | None = None) -> torch.Tensor:
    """``y = x · dequant(W)`` (module formula) by the split-K GEMV kernel (decode rows).

    Args:
        x: ``[M, K]``, 1 ≤ M ≤ ``DECODE_MAX_ROWS``; the rest as ``w4a16_gemm``.
        splits: programs along K per column block (None: ``split_k``); each sums
            ``ceil(K / splits)`` rows rounded up to ``BLOCK_K``, into a float32 workspace
            ``[splits, M, N]`` that torch sums.

    Returns:
        ``[M, N]`` in x's dtype.

    Raises:
        ValueError: more than ``DECODE_MAX_ROWS`` rows, or as ``w4a16_gemm``.
    """
    _check(x, qweight, scales, zeros, g_idx, group_size)
    m, k = x.shape
    if not 1 <= m <= DECODE_MAX_ROWS:
        raise ValueError(f"w4a16_gemv: {m} rows, at most {DECODE_MAX_ROWS}")
    n = qweight.shape[1]
    block_n, block_k, warps, stages = GEMV_CONFIG
    splits = splits or split_k(n, k, x.device)
    per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, per_split)
    ws = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _w4a16_gemv_kernel[(triton.cdiv(n, block_n), splits)](
        x, qweight, scales, zeros, qweight if g_idx is None else g_idx, ws, m, n, k,
        per_split, x.stride(0), GROUP_SIZE=max(group_size, 1), HAS_GIDX=g_idx is not None,
        **_flags(x), BLOCK_M=DECODE_MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)
    return (ws[0] if splits == 1 else ws.sum(0)).to(x.dtype)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, g_idx: torch.Tensor | None = None,
                 group_size: int = 128) -> torch.Tensor:
    """``w4a16_gemv`` for at most ``DECODE_MAX_ROWS`` rows, ``w4a16_gemm`` above (same
    arguments and result); zero rows give ``[0, N]``."""
    if x.shape[0] == 0:
        return x.new_empty(0, qweight.shape[1])
    if x.shape[0] <= DECODE_MAX_ROWS:
        return w4a16_gemv(x, qweight, scales, zeros, g_idx, group_size)
    return w4a16_gemm(x, qweight, scales, zeros, g_idx, group_size)


def unpack_rows(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """The codes ``q [K, N]`` (int32, ``0 .. 15``) of a module-layout ``qweight``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = (qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xF
    return q.reshape(-1, qweight.shape[1])[:k]


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """Codes ``q [K, N]`` (``0 .. 15``) → the module layout's int32 ``[ceil(K/8), N]``
    (K padded with zero codes)."""
    k, n = q.shape
    padded = torch.zeros(triton.cdiv(k, 8) * 8, n, dtype=torch.int32, device=q.device)
    padded[:k] = q.to(torch.int32)
    rows = padded.view(-1, 8, n).to(torch.int64)
    words = sum(rows[:, j] << (4 * j) for j in range(8))
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               g_idx: torch.Tensor | None, group_size: int, k: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """The torch reference: ``W [K, N] = s[g(k)] · (q − z[g(k)])`` in ``dtype`` (default:
    the scales' dtype), computed in that dtype."""
    dtype = dtype or scales.dtype
    groups = (torch.arange(k, device=qweight.device) // group_size if g_idx is None
              else g_idx.long())
    q = unpack_rows(qweight, k).to(dtype)
    return (q - zeros.to(dtype)[groups]) * scales.to(dtype)[groups]
