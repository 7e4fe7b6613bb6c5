"""FP8 (float8_e4m3fn) activation quantization and W8A8 / W8A16 products, with the torch
references the tests compare them to.

Conventions (vLLM's, DeepSeek-V3's): a quantized tensor ``q`` with scale ``s`` stands for
``q.float() * s``; a dynamic scale is ``amax / 448`` (448: e4m3fn's largest finite value,
values clamped to ±448), floored at a tiny positive value so an all-zero row stays zero.

* ``quantize_per_token(x)``: ``x [T, K] → (q [T, K] e4m3fn, s [T, 1] float32)``.
* ``quantize_per_token_group(x, group)``: one scale per ``(token, group columns)``:
  ``s [T, ceil(K / group)]`` (the 1x128 activation groups of block-wise FP8).
* ``quantize_static(x, scale)``: one given scale (a checkpoint's ``input_scale``, a 0-d or
  ``[1]`` float32 tensor).
* ``scaled_mm(xq, sx, wq, sw, out_dtype)``: ``(xq · sx) @ (wq · sw)ᵀ`` with ``sx [T, 1]`` and
  ``sw [N]`` (per output row): ``torch._scaled_mm`` with row-wise scales on a GPU that has
  it (compute capability ≥ 8.9, K and N multiples of 16, bfloat16 output, which is what
  row-wise scaling produces), else the float32 emulation.
* ``block_matmul(xq, sx, wq, sw, block_k, out_dtype)``: block-wise weights (``sw [N,
  ceil(K / block_k)]``, one scale per output row and K block: the checkpoint's
  ``weight_scale_inv`` expanded along rows) times per-token-group activations (``sx [T,
  ceil(K / block_k)]``): a Triton kernel (vLLM's ``w8a8_block_fp8_matmul``: float32
  accumulation, each K block's partial product rescaled by ``sx · sw``); it also runs
  under ``TRITON_INTERPRET=1`` on CPU.
* ``dequantize_rows(wq, sw, block_k)``: the dense float32 weight.

Nothing here synchronizes with the host: all of it runs inside CUDA-graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: e4m3fn's largest finite magnitude.
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
#: Smallest dynamic scale (an all-zero row quantizes to zeros, not NaN).
MIN_SCALE = 1e-12


def expand_columns(scale: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """``scale [R, G]`` (one per row and run of ``group`` columns) → ``[R, k]``, each scale
    over its columns; a view-and-expand (``repeat_interleave`` may read its output size
    back from the device, which CUDA-graph capture forbids)."""
    rows, groups = scale.shape
    return scale.unsqueeze(2).expand(rows, groups, group).reshape(rows, groups * group)[:, :k]


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` (any float dtype) → ``(q [T, K] e4m3fn, s [T, 1] float32)``, ``s =
    max|x_t| / 448`` per row."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_min(MIN_SCALE)
    return _to_fp8(x, scale), scale


def quantize_per_token_group(x: torch.Tensor, group: int
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` → ``(q [T, K] e4m3fn, s [T, ceil(K / group)] float32)``: one scale per
    row and run of ``group`` columns (the last run may be shorter)."""
    t, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k))
    amax = padded.view(t, groups, group).abs().amax(dim=-1)
    scale = (amax / FP8_MAX).clamp_min(MIN_SCALE)
    full = expand_columns(scale, group, k)
    return _to_fp8(x, full), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [T, K]`` → ``q [T, K]`` e4m3fn with the given per-tensor ``scale`` (0-d or
    ``[1]`` float32)."""
    return _to_fp8(x, scale.reshape(1, 1).float())


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight ``[N, K]`` → ``(q [N, K] e4m3fn, s [N] float32)``, one scale per
    output row (vLLM's online ``--quantization fp8`` on a GPU with row-wise scaling)."""
    q, s = quantize_per_token(w)
    return q, s.squeeze(1)


def dequantize_rows(wq: torch.Tensor, sw: torch.Tensor, block_k: int | None = None
                    ) -> torch.Tensor:
    """The float32 ``[N, K]`` weight of ``wq [N, K]`` e4m3fn with scales ``sw [N]`` (per
    row) or ``sw [N, ceil(K / block_k)]`` (per row and K block)."""
    if block_k is None:
        return wq.float() * sw.float().reshape(-1, 1)
    full = expand_columns(sw.float(), block_k, wq.shape[1])
    return wq.float() * full


def fp8_gpu(x: torch.Tensor) -> bool:
    """Whether ``x`` is on a CUDA device with FP8 tensor cores (compute capability ≥ 8.9:
    Ada, Hopper), which ``torch._scaled_mm`` and Triton's FP8 ``tl.dot`` need."""
    return x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)


def scaled_mm_supported(x: torch.Tensor, n: int) -> bool:
    """Whether ``torch._scaled_mm`` with row-wise float32 scales serves ``x [T, K]`` times an
    ``[N, K]`` weight: ``fp8_gpu`` and K, N multiples of 16 (cuBLASLt's FP8 alignment;
    other sizes take the float32 emulation rather than a padded copy)."""
    return fp8_gpu(x) and x.shape[1] % 16 == 0 and n % 16 == 0


def scaled_mm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``(xq · sx) @ (wq · sw)ᵀ → [T, N]`` in ``out_dtype``.

    Args:
        xq: ``[T, K]`` e4m3fn; sx: ``[T, 1]`` float32.
        wq: ``[N, K]`` e4m3fn; sw: ``[N]`` float32.
    """
    if scaled_mm_supported(xq, wq.shape[0]):
        out = torch._scaled_mm(xq, wq.t(), scale_a=sx.float().contiguous(),
                               scale_b=sw.float().reshape(1, -1).contiguous(),
                               out_dtype=torch.bfloat16)
        return out.to(out_dtype)
    y = (xq.float() * sx.float()) @ dequantize_rows(wq, sw).t()
    return y.to(out_dtype)


@triton.jit
def _block_matmul_kernel(X, SX, W, SW, Y, M, N, K, KB,
                         stride_xm, stride_wn, stride_ym, stride_sxm, stride_swn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, KB):
        k = kb * BLOCK_K + offs_k
        mask_k = k < K
        x = tl.load(X + offs_m[:, None] * stride_xm + k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(W + offs_n[None, :] * stride_wn + k[:, None],
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0)
        sx = tl.load(SX + offs_m * stride_sxm + kb, mask=mask_m, other=0.0)
        sw = tl.load(SW + offs_n * stride_swn + kb, mask=mask_n, other=0.0)
        if BLOCK_K < 32:                 # FP8 tl.dot takes K >= 32: exact in float32
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(x, w, out_dtype=tl.float32)
        acc += part * sx[:, None] * sw[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def block_matmul(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                 block_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Block-wise W8A8: ``y[t, n] = Σ_kb sx[t, kb] · sw[n, kb] · (xq[t, kb] · wq[n, kb])``
    → ``[T, N]`` in ``out_dtype`` (float32 accumulation).

    Args:
        xq: ``[T, K]`` e4m3fn; sx: ``[T, ceil(K / block_k)]`` float32.
        wq: ``[N, K]`` e4m3fn; sw: ``[N, ceil(K / block_k)]`` float32.
        block_k: the K block of both scales (a power of two ≥ 16: Triton's ``tl.dot``);
            blocks under 32 (FP8 ``tl.dot``'s least K) multiply their e4m3fn codes as IEEE
            float32, which holds them exactly.

    Raises:
        ValueError: ``block_k`` is not a power of two ≥ 16.
    """
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_matmul needs a power-of-two K block ≥ 16, got {block_k}")
    m, k = xq.shape
    n = wq.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    xq, wq = xq.contiguous(), wq.contiguous()
    sx, sw = sx.float().contiguous(), sw.float().contiguous()
    block_m = 16 if m <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_matmul_kernel[grid](xq, sx, wq, sw, y, m, n, k, triton.cdiv(k, block_k),
                               xq.stride(0), wq.stride(0), y.stride(0), sx.stride(0),
                               sw.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                               BLOCK_K=block_k)
    return y


def block_matmul_reference(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor,
                           sw: torch.Tensor, block_k: int,
                           dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``block_matmul`` in ``dtype`` by dequantizing both sides (the tests' reference, and
    the CPU path's product in float32)."""
    x = xq.to(dtype) * expand_columns(sx.to(dtype), block_k, xq.shape[1])
    w = wq.to(dtype) * expand_columns(sw.to(dtype), block_k, wq.shape[1])
    return x @ w.t()
