"""Triton kernels: a projection by INT4 weights with 16/32-bit activations (W4A16), and the
torch reference that dequantizes.

Every INT4 format (GPTQ, AWQ, compressed-tensors ``pack-quantized``) is repacked once at
load into one layout, which these kernels read:

* ``qweight`` int32 ``[P, N]``, ``P = ceil(K/8)``: nibble ``j`` (bits ``4j .. 4j+3``) of
  word ``i`` holds the unsigned code ``q[j·P + i, n]`` in ``0 .. 15``; nibble plane ``j`` is
  the run of input rows ``j·P .. j·P + P − 1`` (codes past K are zero);
* ``scales`` ``[G, N]`` and ``zeros`` ``[G, N]`` in the activation dtype: the scale and the
  zero point of each group of input rows, the zero point an integer in ``0 .. 16`` (as every
  INT4 format writes it);
* the group of input row ``k``: ``g(k) = k // group_size``, or ``g_idx[k]`` (int32 ``[K]``)
  where the groups are not contiguous runs of ``group_size`` rows.

The product, float32 accumulation, rounded once to x's dtype::

    y[t, n] = Σ_k x[t, k] · s[g(k), n] · (q[k, n] − z[g(k), n])   (+ b[n])

One kernel serves prefill and decode. A program owns a ``BLOCK_M × BLOCK_N`` output tile and
a range of words; each step loads a ``BLOCK_KW × BLOCK_N`` tile of words once and takes its
eight nibble planes, plane ``j`` multiplied by the contiguous columns ``x[·, j·P + i]`` of the
step's words ``i``: no word is read twice and the activations load as vectors. With 16-bit
activations a plane is dequantized two codes per instruction sequence, on two words of the
tile: a byte permute brings nibble ``j`` of both into the low bits of the two 16-bit
halves, one logic op sets those halves' exponent (``bits(2^e) | q`` is the float ``2^e + q``,
``2^e`` = 128 for bfloat16 and 1024 for float16), and two packed half-precision ops give
``(v − (2^e + z)) · s``, bit-equal to the reference's ``(q − z) · s`` in that dtype (``q − z``
is exact for integer zero points, the product rounds once): four instructions for two
codes, and one shift per word for the odd planes.
With float32 activations the codes become float32 by the same trick (``2^e`` = 2²³) and the
dequantization runs in float32. Scales and zeros are taken one row per plane and step where
each plane's rows of a step lie in one group (the step divides the group and planes start on
group boundaries, as with groups of 128 and K a multiple of 1024), else per row. The tiles
multiply on tensor cores (``tl.dot``, ``BLOCK_M`` ≥ 16 rows, chained in one float32
accumulator). Shapes that divide into whole tiles (``N`` by ``BLOCK_N``, ``P`` by
``BLOCK_KW``, ``K`` a multiple of 8) load without masks but the rows'. Decode rows (up to
``DECODE_MAX_ROWS``) split K over ``splits`` programs per output tile so that a skinny
product fills the GPU (split-K, as decode GEMV kernels do), reduced in the same launch and
in a fixed order (``manylora.ops.split_k``). No host synchronisation: CUDA-graph safe. Under
``TRITON_INTERPRET=1`` (CPU tensors) the float32 path runs (the interpreter runs no inline
assembly, and multiplies bfloat16 bit patterns as integers).

GPTQ's own row packing (nibble ``j`` of word ``i`` holds row ``8i + j``) is read by
``unpack_rows`` for the formats' loaders; ``pack_rows`` is its inverse.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from manylora.ops.split_k import (
    MAX_SPLIT_TILES,
    split_count,
    split_workspace,
    store_split,
    whole_step_splits,
)

#: Rows up to which ``w4a16_linear`` splits K (decode); more rows take one program per
#: output tile over all of K (prefill).
DECODE_MAX_ROWS = 64
#: Row bucket → ``(BLOCK_M, BLOCK_N, BLOCK_KW, num_warps, num_stages, programs per SM)`` for
#: decode rows (the smallest bucket ≥ the row count; ``BLOCK_M`` ≥ 16, ``tl.dot``'s least):
#: ``BLOCK_KW`` words per step, K split until about ``programs per SM`` programs run per
#: streaming multiprocessor. Measured by ``benchmarks/bench_quant_kernels.py``.
DECODE_CONFIGS: dict[int, tuple[int, int, int, int, int, int]] = {
    16: (16, 64, 64, 4, 2, 2),
    32: (32, 64, 64, 4, 2, 2),
    64: (64, 64, 32, 4, 2, 2),
}
#: Prefill's ``(BLOCK_M, BLOCK_N, BLOCK_KW, num_warps, num_stages)``.
GEMM_CONFIG = (64, 64, 16, 4, 3)


def _dequant_asm(magic: int) -> str:
    """PTX for two codes of plane ``j``: ``$1``, ``$2`` two words of the tile (shifted right
    by 4 for odd ``j``), ``$5`` the byte permute taking byte ``j // 2`` of each into the low
    byte of a 16-bit half, ``$3 = −(2^e + z)`` and ``$4 = s`` packed 16-bit pairs of the same
    two elements; ``$0`` their dequantized pair. ``magic`` is the 16-bit pattern of
    ``2^e``."""
    kind = "bf16x2" if magic == 0x4300 else "f16x2"
    one = 0x3F80 if magic == 0x4300 else 0x3C00
    return f"""
    {{
    .reg .b32 t, v, d, one, zero;
    mov.b32 one, {one << 16 | one:#x};
    mov.b32 zero, 0x80008000;
    prmt.b32 t, $1, $2, $5;
    lop3.b32 v, t, 0x000F000F, {magic << 16 | magic:#x}, 0xEA;
    fma.rn.{kind} d, $3, one, v;
    fma.rn.{kind} $0, d, $4, zero;
    }}
    """


_ASM_BF16 = tl.constexpr(_dequant_asm(0x4300))
_ASM_F16 = tl.constexpr(_dequant_asm(0x6400))
_MAGIC = tl.constexpr(0x4B000000)          # the float32 bits of 2**23


@triton.jit
def _codes(words, j: tl.constexpr):
    """Nibble plane ``j`` of ``words`` as exact float32 codes ``0 .. 15`` (the exponent
    trick: ``bits(2²³) | q`` is the float ``2²³ + q``)."""
    bits = ((words >> (4 * j)) & 0xF) | _MAGIC
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _dequant16(words, z, s, byte: tl.constexpr):
    """``s · (q − z)`` in s's 16-bit dtype for the codes in the low nibble of byte ``byte``
    of ``words`` (int32, any shape; ``z``, ``s`` broadcast to it), two codes per inline
    assembly block (``_dequant_asm``)."""
    sel = tl.full(words.shape, byte | ((4 + byte) << 8), tl.int32)
    if s.dtype == tl.float16:
        out = tl.inline_asm_elementwise(_ASM_F16, "=r,r,r,r,r,r,r",
                                        [words, -(z + 1024.0).to(tl.float16), s, sel],
                                        dtype=tl.float16, is_pure=True, pack=2)
    else:
        out = tl.inline_asm_elementwise(_ASM_BF16, "=r,r,r,r,r,r,r",
                                        [words, -(z + 128.0).to(tl.bfloat16), s, sel],
                                        dtype=tl.bfloat16, is_pure=True, pack=2)
    return out


@triton.jit
def _product(acc, x, w, IEEE: tl.constexpr):
    """``acc + x @ w`` on tensor cores (``x [BM, BKW]``, ``w [BKW, BN]`` of one dtype, ``acc
    [BM, BN]`` float32); float32 operands as IEEE float32 products or TF32 ones."""
    if IEEE:
        out = tl.dot(x, w, acc, input_precision="ieee")
    else:
        out = tl.dot(x, w, acc)
    return out


@triton.jit(do_not_specialize=["M", "STEPS_PER_SPLIT"])
def _w4a16_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, b_ptr, ws_ptr, count_ptr, y_ptr, M, N,
                  K, PLANE, STEPS_PER_SPLIT, stride_xm, stride_ym, GROUP_SIZE: tl.constexpr,
                  MODE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                  DOT_FP32: tl.constexpr, IEEE: tl.constexpr, EVEN: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    # MODE 0: each plane's rows of a step in one group (one scale row per plane and step);
    # 1: groups of GROUP_SIZE rows, per row; 2: groups by g_idx, per row. EVEN: N, PLANE
    # and K divide into whole tiles (no masks but the rows')
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    # PLANE = ceil(K / 8), rows per nibble plane, an argument so that the compiler sees its
    # divisibility (and the activations' 16-byte alignment); splits are whole steps
    plane = PLANE
    if SPLIT:
        kw_start = pid_k * STEPS_PER_SPLIT * BLOCK_KW
        kw_stop = tl.minimum(kw_start + STEPS_PER_SPLIT * BLOCK_KW, plane)
    else:
        kw_start = 0
        kw_stop = plane
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kw0 in range(kw_start, kw_stop, BLOCK_KW):
        offs_kw = kw0 + tl.arange(0, BLOCK_KW)
        kw_mask = offs_kw < plane                 # splits start on BLOCK_KW boundaries
        w_ptrs = q_ptr + offs_kw[:, None] * N + offs_n[None, :]
        if EVEN:
            words = tl.load(w_ptrs)
        else:
            words = tl.load(w_ptrs, mask=kw_mask[:, None] & n_mask[None, :], other=0)
        if not DOT_FP32:
            words_hi = words >> 4
        for j in tl.static_range(8):
            offs_k = j * plane + offs_kw
            k_mask = kw_mask & (offs_k < K)
            if EVEN:
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            else:
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                            other=0.0)
            if MODE == 0:                         # one scale row per plane and step
                gn = ((j * plane + kw0) // GROUP_SIZE) * N + offs_n
                if EVEN:
                    s = tl.load(s_ptr + gn)[None, :]
                    z = tl.load(z_ptr + gn)[None, :]
                else:
                    g_mask = n_mask & (offs_n * 0 + j * plane + kw0 < K)   # planes past K
                    s = tl.load(s_ptr + gn, mask=g_mask, other=0.0)[None, :]
                    z = tl.load(z_ptr + gn, mask=g_mask, other=0.0)[None, :]
            else:
                if MODE == 1:
                    g = offs_k // GROUP_SIZE
                else:
                    g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)
                gn = g[:, None] * N + offs_n[None, :]
                g_mask = k_mask[:, None] & n_mask[None, :]
                s = tl.load(s_ptr + gn, mask=g_mask, other=0.0)
                z = tl.load(z_ptr + gn, mask=g_mask, other=0.0)
            if DOT_FP32:
                w = (_codes(words, j) - z.to(tl.float32)) * s.to(tl.float32)
                x = x.to(tl.float32)
            else:
                w = _dequant16(words if j % 2 == 0 else words_hi, z, s, j // 2)
            acc = _product(acc, x, w, IEEE)
    store_split(acc, ws_ptr, count_ptr, b_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym,
                pid_m * tl.num_programs(0) + pid_n, HAS_BIAS, SPLIT)


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
           zeros: torch.Tensor, g_idx: torch.Tensor | None, group_size: int,
           bias: torch.Tensor | None) -> None:
    m, k = x.shape
    n = qweight.shape[1]
    if (qweight.dtype != torch.int32 or qweight.shape[0] != triton.cdiv(k, 8)
            or scales.shape != zeros.shape or scales.shape[1] != n or x.stride(1) != 1
            or not (qweight.is_contiguous() and scales.is_contiguous()
                    and zeros.is_contiguous())
            or (g_idx is None and (group_size <= 0 or scales.shape[0] < triton.cdiv(k, group_size)))
            or (g_idx is not None and (g_idx.shape != (k,) or g_idx.dtype != torch.int32))
            or (bias is not None and tuple(bias.shape) != (n,))):
        raise ValueError(f"w4a16: x {tuple(x.shape)} (strides {x.stride()}), qweight "
                         f"{tuple(qweight.shape)} {qweight.dtype}, scales "
                         f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)}, g_idx "
                         f"{None if g_idx is None else tuple(g_idx.shape)}, group_size "
                         f"{group_size}, bias {None if bias is None else tuple(bias.shape)}")


def decode_config(rows: int) -> tuple[int, int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_KW, num_warps, num_stages, programs per SM)`` for
    ``rows`` decode rows (1 ≤ rows ≤ ``DECODE_MAX_ROWS``): the smallest ``DECODE_CONFIGS``
    bucket that holds them."""
    return DECODE_CONFIGS[min(b for b in DECODE_CONFIGS if b >= rows)]


def split_k(n: int, k: int, block_n: int, block_kw: int, programs_per_sm: int,
            device: torch.device) -> int:
    """The K split for an ``[K, N]`` weight at one row tile (``split_k.split_count`` over
    its column tiles and its steps of ``8 · block_kw`` input rows)."""
    return split_count(triton.cdiv(n, block_n), triton.cdiv(triton.cdiv(k, 8), block_kw),
                       programs_per_sm, device)


def _flags(x: torch.Tensor) -> dict[str, bool]:
    on_gpu = x.device.type == "cuda"
    return {"DOT_FP32": not on_gpu or x.dtype == torch.float32,
            "IEEE": on_gpu and x.dtype == torch.float32}


def _mode(k: int, g_idx: torch.Tensor | None, group_size: int, block_kw: int) -> int:
    """The kernel's group layout: 0 where every plane's rows of every step lie in one group
    (steps of ``block_kw`` rows dividing the group, planes starting on group boundaries, or
    one group over K), 1 for other runs of ``group_size`` rows, 2 for ``g_idx``."""
    if g_idx is not None:
        return 2
    plane = triton.cdiv(k, 8)
    if group_size >= k or (group_size % block_kw == 0 and plane % group_size == 0):
        return 0
    return 1


def _launch(x, qweight, scales, zeros, g_idx, group_size, bias, block_m, block_n, block_kw,
            warps, stages, splits) -> torch.Tensor:
    m, k = x.shape
    n = qweight.shape[1]
    plane = triton.cdiv(k, 8)
    steps = triton.cdiv(plane, block_kw)
    per_split, splits = whole_step_splits(steps, splits)
    grid = (triton.cdiv(n, block_n), splits, triton.cdiv(m, block_m))
    if splits > 1 and grid[0] * grid[2] > MAX_SPLIT_TILES:
        raise ValueError(f"w4a16: {grid[0] * grid[2]} output tiles split over K, at most "
                         f"{MAX_SPLIT_TILES}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ws, counters = split_workspace(splits, m, n, y)
    mode = _mode(k, g_idx, group_size, block_kw)
    even = n % block_n == 0 and plane % block_kw == 0 and k == 8 * plane
    key = (x.dtype, mode, even, block_m, block_n, block_kw, warps, stages)
    stages = _stages_that_fit.get(key, stages)
    while True:
        try:
            _w4a16_kernel[grid](
                x, qweight, scales, zeros, qweight if g_idx is None else g_idx,
                qweight if bias is None else bias, ws, counters, y, m, n, k, plane, per_split,
                x.stride(0), y.stride(0), GROUP_SIZE=max(group_size, 1), MODE=mode,
                HAS_BIAS=bias is not None, SPLIT=splits > 1, **_flags(x), EVEN=even,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KW=block_kw, num_warps=warps,
                num_stages=stages)
            return y
        except OutOfResources:
            # float32 activations' tiles take twice the shared memory of 16-bit ones: one
            # pipeline stage fewer (the same split and grid), remembered for the next launch
            if stages == 1:
                raise
            stages -= 1
            _stages_that_fit[key] = stages


#: ``(dtype, MODE, EVEN, BLOCK_M, BLOCK_N, BLOCK_KW, num_warps, num_stages)`` → the pipeline stages
#: a launch of that config took after running out of shared memory with more.
_stages_that_fit: dict[tuple, int] = {}


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, g_idx: torch.Tensor | None = None,
               group_size: int = 128, bias: torch.Tensor | None = None,
               config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``y = x · dequant(W) (+ b)`` (module formula), one program per output tile over all of
    K on tensor cores (prefill rows; any row count).

    Args:
        x: ``[M, K]`` float32/bfloat16/float16, last dimension contiguous.
        qweight: int32 ``[ceil(K/8), N]`` (module layout).
        scales, zeros: ``[G, N]``, contiguous; zero points integers in ``0 .. 16``.
        g_idx: int32 ``[K]``, each row's group, or None: ``k // group_size``.
        group_size: input rows per group (used without ``g_idx``).
        bias: ``[N]`` or None, added before the rounding.
        config: ``(BLOCK_M, BLOCK_N, BLOCK_KW, num_warps, num_stages)``, None:
            ``GEMM_CONFIG``.

    Returns:
        ``[M, N]`` in x's dtype.

    Raises:
        ValueError: shapes, dtypes or layouts that do not fit together.
    """
    _check(x, qweight, scales, zeros, g_idx, group_size, bias)
    block_m, block_n, block_kw, warps, stages = config or GEMM_CONFIG
    return _launch(x, qweight, scales, zeros, g_idx, group_size, bias, block_m, block_n,
                   block_kw, warps, stages, 1)


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, g_idx: torch.Tensor | None = None,
               group_size: int = 128, bias: torch.Tensor | None = None,
               splits: int | None = None,
               config: tuple[int, int, int, int, int, int] | None = None) -> torch.Tensor:
    """``y = x · dequant(W) (+ b)`` (module formula) with K split over programs (decode
    rows).

    Args:
        x: ``[M, K]``, 1 ≤ M ≤ ``DECODE_MAX_ROWS``; the rest as ``w4a16_gemm``.
        splits: programs along K per output tile (None: ``split_k``); each sums a whole
            number of steps of ``BLOCK_KW`` words.
        config: ``decode_config``'s tuple (None: ``decode_config(M)``); ``BLOCK_M`` ≥ M.

    Returns:
        ``[M, N]`` in x's dtype.

    Raises:
        ValueError: more than ``DECODE_MAX_ROWS`` rows, a config whose ``BLOCK_M`` is short
            of M, or as ``w4a16_gemm``.
    """
    _check(x, qweight, scales, zeros, g_idx, group_size, bias)
    m, k = x.shape
    if not 1 <= m <= DECODE_MAX_ROWS:
        raise ValueError(f"w4a16_gemv: {m} rows, at most {DECODE_MAX_ROWS}")
    block_m, block_n, block_kw, warps, stages, per_sm = config or decode_config(m)
    if block_m < m:
        raise ValueError(f"w4a16_gemv: {m} rows over a BLOCK_M of {block_m}")
    n = qweight.shape[1]
    splits = splits or split_k(n, k, block_n, block_kw, per_sm, x.device)
    return _launch(x, qweight, scales, zeros, g_idx, group_size, bias, block_m, block_n,
                   block_kw, warps, stages, splits)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, g_idx: torch.Tensor | None = None,
                 group_size: int = 128, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``w4a16_gemv`` for at most ``DECODE_MAX_ROWS`` rows, ``w4a16_gemm`` above (same
    arguments and result); zero rows give ``[0, N]``."""
    if x.shape[0] == 0:
        return x.new_empty(0, qweight.shape[1])
    if x.shape[0] <= DECODE_MAX_ROWS:
        return w4a16_gemv(x, qweight, scales, zeros, g_idx, group_size, bias)
    return w4a16_gemm(x, qweight, scales, zeros, g_idx, group_size, bias)


def pack_planes(q: torch.Tensor) -> torch.Tensor:
    """Codes ``q [K, N]`` (``0 .. 15``) → the module layout's int32 ``[ceil(K/8), N]``: nibble
    ``j`` of word ``i`` holds row ``j · ceil(K/8) + i`` (K padded with zero codes)."""
    k, n = q.shape
    plane = triton.cdiv(k, 8)
    padded = torch.zeros(plane * 8, n, dtype=torch.int64, device=q.device)
    padded[:k] = q.to(torch.int64)
    rows = padded.view(8, plane, n)
    words = sum(rows[j] << (4 * j) for j in range(8))
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_planes(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """The codes ``q [K, N]`` (int32, ``0 .. 15``) of a module-layout ``qweight``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = (qweight.unsqueeze(0) >> shifts[:, None, None]) & 0xF     # [8, ceil(K/8), N]
    return q.reshape(-1, qweight.shape[1])[:k]


def unpack_rows(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """The codes ``q [K, N]`` (int32, ``0 .. 15``) of GPTQ's row packing: nibble ``j`` of
    word ``i`` holds row ``8i + j``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = (qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xF
    return q.reshape(-1, qweight.shape[1])[:k]


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """Codes ``q [K, N]`` (``0 .. 15``) → GPTQ's row packing, int32 ``[ceil(K/8), N]`` (K
    padded with zero codes)."""
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
    q = unpack_planes(qweight, k).to(dtype)
    return (q - zeros.to(dtype)[groups]) * scales.to(dtype)[groups]
