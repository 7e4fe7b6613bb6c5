"""Fused elementwise Triton kernels of the decoder layer: RMSNorm (+ residual add), SiLU-and-mul
and rotary embedding, one launch each.

Follows vLLM's ``rms_norm`` / ``fused_add_rms_norm``, ``silu_and_mul`` and
``rotary_embedding`` custom ops, with the rounding of Hugging Face transformers' Llama (the
engine's outputs are compared against it): every intermediate that the PyTorch code rounds to
the activation dtype is rounded here too, to nearest-even, in the same order. Concretely, for
an activation dtype ``dt`` (float32, bfloat16 or float16) and ``r(.)`` rounding a float32
value to ``dt``:

* RMSNorm (HF's ``LlamaRMSNorm``): ``h = x.float()``,
  ``out = r_out(w * r(h * rsqrt(mean(h * h) + eps)))``; with a residual (vLLM's
  ``fused_add_rms_norm``) ``h = r(x + residual)`` is also returned. Gemma's ``(1 + w)``
  variant (``unit_offset``, HF's ``Gemma2RMSNorm``): ``out = r(h * rsqrt(...) * (1 + w))``,
  the product in float32 and one rounding.
* SiLU-and-mul (HF's ``act_fn(gate) * up``): ``out = r(r(g / (1 + exp(-g))) * u)``.
* RoPE (HF's ``apply_rotary_pos_emb``): ``c = r(cos[p])``, ``s = r(sin[p])``,
  ``q' = r(r(q * c) + r(rotate_half(q) * s))``, the same for ``k``.

All arithmetic is float32, with IEEE division (``div_rn``) and floating-point contraction
(FMA fusion) turned off, since PyTorch rounds every product before it adds. What can still
differ from PyTorch in the last float32 bits: the order of the sum of squares in RMSNorm, and
``exp`` / ``rsqrt``. On a GPU the kernels call libdevice's ``expf`` / ``rsqrtf``, the CUDA
math functions PyTorch's CUDA kernels use (not ``tl.exp``, an approximate ``ex2``); under
Triton's interpreter they get numpy's ``exp`` (PyTorch's CPU kernels use SLEEF's, which at
times differs in the last bit) and ``1 / sqrt`` (as PyTorch's CPU ``rsqrt``). In bfloat16 /
float16 such a difference only shows when it moves the rounded intermediate (the normalized
``x``, ``silu(g)``) across a rounding boundary: rarely, and then by one unit in the last place
of that intermediate. RoPE and the residual add involve neither and match PyTorch bit for bit
(``tests/ops/test_fused_ops.py`` asserts and measures all of this).

Rounding to bfloat16 is done with integer arithmetic on the float32 bits (round to nearest,
ties to even, NaN kept), because Triton's interpreter truncates on a float32 → bfloat16 cast;
the result is then exactly representable, so the cast of the store is exact on every backend.

The wrappers are CUDA-graph safe: no host synchronisation, no ``.item()``, grids and block
sizes only from tensor shapes (no autotuning); outputs are allocated unless given through
``out=`` (RoPE works in place). The first call of a shape class compiles the kernel, so warm
up once before capturing a graph. They run on CUDA tensors, and on CPU tensors under
``TRITON_INTERPRET=1`` (how the tests run them without a GPU). Supported dtypes: float32,
bfloat16, float16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from manylora.ops.host_math import cdiv, next_power_of_2

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# RMSNorm keeps a row of up to this many elements in registers (one pass over memory);
# wider rows are processed in chunks of this size (two passes: sum of squares, normalize).
_MAX_ROW_BLOCK = 16384
# Elements of the intermediate dimension one SiLU-and-mul program handles.
_SILU_BLOCK = 1024
# Elements (heads x half head_dim) of q or k one RoPE program rotates, per half.
_ROPE_TILE = 1024


# ---------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _round(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to ``dtype`` (nearest, ties to even), returned as float32."""
    y = x
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        y = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
        y = tl.where(x == x, y, x)
    elif dtype == tl.float16:
        y = x.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def _exp(x, GPU_MATH: tl.constexpr):
    """float32 ``exp``: libdevice's ``expf`` (PyTorch's CUDA kernels) or ``tl.exp``, numpy's
    ``exp`` under the interpreter (Triton lowers ``tl.exp`` to the approximate ``ex2`` on a
    GPU, so it is not used there)."""
    if GPU_MATH:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _rsqrt(x, GPU_MATH: tl.constexpr):
    """float32 ``rsqrt``: libdevice's ``rsqrtf`` (PyTorch's CUDA ``rsqrt``) or ``tl.rsqrt``,
    ``1 / sqrt`` under the interpreter (PyTorch's CPU ``rsqrt``)."""
    if GPU_MATH:
        y = libdevice.rsqrt(x)
    else:
        y = tl.rsqrt(x)
    return y


# ---------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
        stride_x, stride_res, stride_out, stride_res_out, n_cols, eps,
        HAS_RESIDUAL: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK: tl.constexpr,
        GPU_MATH: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """Grid ``(rows,)``: one program normalizes one row of ``n_cols`` elements;
    ``UNIT_OFFSET``: times ``1 + w`` in float32, rounded once (Gemma)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    res_row = res_ptr + row * stride_res
    out_row = out_ptr + row * stride_out
    res_out_row = res_out_ptr + row * stride_res_out
    act: tl.constexpr = x_ptr.dtype.element_ty
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = cols < n_cols
        h = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
            h = _round(h + r, act)
            tl.store(res_out_row + cols, h, mask=mask)
        var = tl.math.div_rn(tl.sum(h * h, axis=0), tl.cast(n_cols, tl.float32))
        inv = _rsqrt(var + eps, GPU_MATH)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            y = _round(h * inv * (1.0 + w), out_dtype)
        else:
            y = _round(w * _round(h * inv, act), out_dtype)
        tl.store(out_row + cols, y, mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
                h = _round(h + r, act)
                tl.store(res_out_row + offs, h, mask=mask)
            acc += h * h
        var = tl.math.div_rn(tl.sum(acc, axis=0), tl.cast(n_cols, tl.float32))
        inv = _rsqrt(var + eps, GPU_MATH)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            # Same offsets and layout as the first pass: each thread reads back its own stores.
            if HAS_RESIDUAL:
                h = tl.load(res_out_row + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if UNIT_OFFSET:
                y = _round(h * inv * (1.0 + w), out_dtype)
            else:
                y = _round(w * _round(h * inv, act), out_dtype)
            tl.store(out_row + offs, y, mask=mask)


@triton.jit
def silu_mul(g, u, act: tl.constexpr, GPU_MATH: tl.constexpr):
    """``r(r(g / (1 + exp(-g))) * u)`` of float32 ``g``, ``u`` with ``r`` rounding to ``act``
    (HF's ``act_fn(gate) * up``), as float32. Bit-exact only in a kernel compiled with
    ``enable_fp_fusion=False``; ``GPU_MATH``: :data:`GPU_MATH`."""
    s = _round(tl.math.div_rn(g, 1.0 + _exp(-g, GPU_MATH)), act)
    return _round(s * u, act)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_inter,
                         BLOCK: tl.constexpr, GPU_MATH: tl.constexpr):
    """Grid ``(rows, cdiv(n_inter, BLOCK))``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_inter
    act: tl.constexpr = x_ptr.dtype.element_ty
    x_row = x_ptr + row * stride_x
    g = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + n_inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, silu_mul(g, u, act, GPU_MATH), mask=mask)


@triton.jit
def _rope_heads(row_ptr, stride_h, head0, n_heads, c_lo, c_hi, s_lo, s_hi, half,
                BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate heads ``head0 .. head0 + BLOCK_H`` (those ``< n_heads``) of one token, in place.

    ``c_* / s_*``: ``[BLOCK_HALF]`` cos / sin of the token, already rounded to the dtype, for
    the first (``lo``) and second (``hi``) half of the head.
    """
    act: tl.constexpr = row_ptr.dtype.element_ty
    heads = head0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < n_heads) & (d[None, :] < half)
    ptrs = row_ptr + heads[:, None] * stride_h + d[None, :]
    lo = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(ptrs + half, mask=mask, other=0.0).to(tl.float32)
    # rotate_half(x) = cat(-x_hi, x_lo)
    out_lo = _round(_round(lo * c_lo[None, :], act) + _round(-hi * s_lo[None, :], act), act)
    out_hi = _round(_round(hi * c_hi[None, :], act) + _round(lo * s_hi[None, :], act), act)
    tl.store(ptrs, out_lo, mask=mask)
    tl.store(ptrs + half, out_hi, mask=mask)


# positions: a view at an offset of the step's input buffer that moves with the row count.
@triton.jit(do_not_specialize=["pos_ptr"])
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
                   n_q_heads, n_k_heads, half,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Grid ``(tokens, cdiv(n_q_heads, BLOCK_H) + cdiv(n_k_heads, BLOCK_H))``: program
    ``(t, j)`` rotates one block of heads of q (the first blocks) or of k (the rest)."""
    tok = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    act: tl.constexpr = q_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < half
    cos_row = cos_ptr + pos * stride_cos
    sin_row = sin_ptr + pos * stride_sin
    c_lo = _round(tl.load(cos_row + d, mask=dmask, other=0.0).to(tl.float32), act)
    c_hi = _round(tl.load(cos_row + half + d, mask=dmask, other=0.0).to(tl.float32), act)
    s_lo = _round(tl.load(sin_row + d, mask=dmask, other=0.0).to(tl.float32), act)
    s_hi = _round(tl.load(sin_row + half + d, mask=dmask, other=0.0).to(tl.float32), act)
    q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    if blk < q_blocks:
        _rope_heads(q_ptr + tok * stride_qt, stride_qh, blk * BLOCK_H, n_q_heads,
                    c_lo, c_hi, s_lo, s_hi, half, BLOCK_H, BLOCK_HALF)
    else:
        _rope_heads(k_ptr + tok * stride_kt, stride_kh, (blk - q_blocks) * BLOCK_H, n_k_heads,
                    c_lo, c_hi, s_lo, s_hi, half, BLOCK_H, BLOCK_HALF)


# Under TRITON_INTERPRET=1, triton.jit gives interpreter objects instead of JITFunctions: the
# interpreter has no libdevice, so the kernels fall back to tl.exp / tl.rsqrt (numpy) there.
#: Whether the kernels compile for a GPU (libdevice math) rather than run in the interpreter.
GPU_MATH = isinstance(_silu_and_mul_kernel, triton.runtime.JITFunction)


# ---------------------------------------------------------------------------------------------
# wrappers


def _check_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"tensors on different devices: {[str(t.device) for t in tensors]}")
    if GPU_MATH and device.type != "cuda":
        raise ValueError(f"Triton kernels need CUDA tensors (got {device}); CPU tensors run "
                         "only under TRITON_INTERPRET=1")


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} is not one of {_DTYPES}")


def _in_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Input ``t`` as ``[rows, n_cols]`` with unit column stride; a view when strides allow."""
    t = t.reshape(-1, n_cols)
    return t if t.stride(1) == 1 else t.contiguous()


def _out_rows(name: str, out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
              like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, out as a [rows, shape[-1]] view)``; a new tensor when ``out`` is None."""
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=like.device)
    elif out.shape != shape or out.dtype != dtype or out.device != like.device:
        raise ValueError(f"{name}: expected {tuple(shape)} {dtype} on {like.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if out.numel() == 0:
        return out, out               # nothing to launch
    try:
        rows = out.view(-1, shape[-1])
    except RuntimeError as e:
        raise ValueError(f"{name}: strides {out.stride()} cannot be viewed as rows") from e
    if rows.stride(1) != 1 and shape[-1] > 1:
        raise ValueError(f"{name}: needs unit stride along the last dimension, got "
                         f"{out.stride()}")
    return out, rows


def _rms_norm_launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, out: torch.Tensor | None, residual_out: torch.Tensor | None,
                     block_size: int | None, unit_offset: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    n_cols = x.shape[-1] if x.dim() else 0
    _check_dtype("x", x)
    _check_dtype("weight", weight)
    if x.dim() == 0 or weight.shape != (n_cols,):
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: expected "
                         "[..., N] and [N]")
    tensors = [x, weight]
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                             f"x {tuple(x.shape)} {x.dtype}")
        tensors.append(residual)
    _check_device(*tensors)
    if block_size is None:
        block = min(next_power_of_2(max(n_cols, 1)), _MAX_ROW_BLOCK)
    elif block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    else:
        block = block_size
    out_dtype = x.dtype if unit_offset else torch.promote_types(weight.dtype, x.dtype)
    out, out2 = _out_rows("out", out, x.shape, out_dtype, x)
    res_out = res_out2 = None
    if residual is not None:
        res_out, res_out2 = _out_rows("residual_out", residual_out, x.shape, x.dtype, x)
    if x.numel() == 0:
        return out, res_out
    rows = out2.shape[0]
    x2 = _in_rows(x, n_cols)
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    if residual is None:
        r2 = res_out2 = x2            # not read (HAS_RESIDUAL=False)
    else:
        r2 = _in_rows(residual, n_cols)
    _rms_norm_kernel[(rows,)](
        x2, r2, w, out2, res_out2,
        x2.stride(0), r2.stride(0), out2.stride(0), res_out2.stride(0), n_cols, eps,
        HAS_RESIDUAL=residual is not None, ONE_PASS=block >= n_cols, BLOCK=block,
        GPU_MATH=GPU_MATH, UNIT_OFFSET=unit_offset, num_warps=max(1, min(16, block // 512)),
        enable_fp_fusion=False)
    return out, res_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                    out: torch.Tensor | None = None, block_size: int | None = None,
                    unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm as HF's ``LlamaRMSNorm`` rounds it; vLLM's ``rms_norm`` op, one launch.

    ``out = weight * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype)``: the
    statistic and the normalization in float32, rounded to ``x.dtype``, then the product with
    the weight rounded to ``promote_types(weight.dtype, x.dtype)``.

    Args:
        x: ``[..., N]`` float32 / bfloat16 / float16, any strides (``[T, N]`` in the model).
        weight: ``[N]``, float32 / bfloat16 / float16.
        eps: added to the mean square (rounded to float32, as in PyTorch).
        out: optional destination, ``x``'s shape, dtype ``promote_types(weight.dtype,
            x.dtype)``, viewable as ``[rows, N]`` with unit stride along ``N``; it may be
            ``x`` itself (in place).
        block_size: columns a program holds at once, a power of two; default the row rounded
            up to a power of two, at most 16384 (wider rows take two passes over memory).
        unit_offset: Gemma's variant (HF's ``Gemma2RMSNorm``): ``out = (x.float() * rsqrt(
            ...) * (1 + weight.float())).to(x.dtype)``, ``out`` of ``x``'s dtype.

    Returns:
        ``out`` (a new contiguous tensor unless given).

    Raises:
        ValueError: dtypes, shapes, strides or devices it does not take.
    """
    return _rms_norm_launch(x, None, weight, eps, out, None, block_size, unit_offset)[0]


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float, *, out: torch.Tensor | None = None,
                              residual_out: torch.Tensor | None = None,
                              block_size: int | None = None, unit_offset: bool = False,
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add and RMSNorm in one launch; vLLM's ``fused_add_rms_norm`` op.

    ``new_residual = x + residual`` rounded to the dtype (a PyTorch add in that dtype) and
    ``out = rms_norm(new_residual)`` exactly as :func:`rms_norm_triton`.

    Args:
        x, residual: ``[..., N]``, same shape and dtype (float32 / bfloat16 / float16).
        weight, eps, block_size, unit_offset: as in :func:`rms_norm_triton`.
        out: optional destination of the norm, as in :func:`rms_norm_triton`; it may be
            ``x`` itself.
        residual_out: optional destination of ``new_residual``, ``x``'s shape and dtype; it
            may be ``residual`` itself (vLLM's in-place form). ``out`` and ``residual_out``
            must not overlap each other, nor any input other than the one named.

    Returns:
        ``(out, new_residual)``: new contiguous tensors unless given. By default no input is
        modified.

    Raises:
        ValueError: dtypes, shapes, strides or devices it does not take.
    """
    out, res_out = _rms_norm_launch(x, residual, weight, eps, out, residual_out, block_size,
                                    unit_offset)
    assert res_out is not None
    return out, res_out


def silu_and_mul_triton(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` in one launch; vLLM's ``silu_and_mul`` op.

    HF's Llama MLP rounding, ``act_fn(gate) * up`` in the dtype: ``s = g / (1 + exp(-g))`` in
    float32 rounded to the dtype, then ``s * u`` rounded to the dtype.

    Args:
        x: ``[..., 2 * I]`` float32 / bfloat16 / float16, the packed ``gate_up_proj`` output
            (gate columns first), any strides.
        out: optional destination ``[..., I]`` of ``x.dtype``, viewable as ``[rows, I]`` with
            unit stride along ``I``, not overlapping ``x``.

    Returns:
        ``out`` (a new contiguous tensor unless given).

    Raises:
        ValueError: an odd last dimension, or a dtype, shape or device it does not take.
    """
    _check_dtype("x", x)
    _check_device(x)
    width = x.shape[-1] if x.dim() else 1
    if width % 2:
        raise ValueError(f"last dimension must be even (gate and up halves), got {width}")
    n_inter = width // 2
    out, out2 = _out_rows("out", out, (*x.shape[:-1], n_inter), x.dtype, x)
    if out.numel() == 0:
        return out
    rows = out2.shape[0]
    x2 = _in_rows(x, width)
    block = min(next_power_of_2(n_inter), _SILU_BLOCK)
    grid = (rows, cdiv(n_inter, block))
    _silu_and_mul_kernel[grid](x2, out2, x2.stride(0), out2.stride(0), n_inter,
                               BLOCK=block, GPU_MATH=GPU_MATH, num_warps=4,
                               enable_fp_fusion=False)
    return out


def rotary_embedding_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q and k in place, one launch; vLLM's ``rotary_embedding`` op (neox layout).

    HF's ``apply_rotary_pos_emb`` rounding: with ``c = cos[p].to(dt)``, ``s = sin[p].to(dt)``
    and ``rotate_half(x) = cat(-x[D/2:], x[:D/2])``, ``x' = x * c + rotate_half(x) * s`` with
    each product and the sum rounded to the dtype ``dt``. Element ``d`` pairs with
    ``d + D/2``.

    Args:
        positions: ``[T]`` integer positions (any order), each ``< cos.shape[0]`` (not
            checked: no host sync).
        q: ``[T, Hq, D]``, k: ``[T, Hkv, D]``, same dtype (float32 / bfloat16 / float16),
            ``D`` even, unit stride along ``D``; token and head strides are free, so the views
            of a packed qkv output (``qkv.split(...)`` then ``.view(T, H, D)``) are rotated
            where they lie, without a copy. q and k must not overlap.
        cos, sin: ``[max_position, D]`` float tables (float32 in the model), unit stride
            along ``D``; both halves of a row are read.

    Returns:
        ``(q, k)``, the same tensors, rotated in place.

    Raises:
        ValueError: shapes, strides, dtypes or devices it does not take.
    """
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    n_tok, n_q_heads, head_dim = q.shape
    n_k_heads = k.shape[1]
    if k.shape[0] != n_tok or k.shape[2] != head_dim or positions.shape != (n_tok,):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and positions "
                         f"{tuple(positions.shape)} disagree")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k dtypes differ: {q.dtype}, {k.dtype}")
    _check_dtype("q", q)
    _check_dtype("cos", cos)
    _check_dtype("sin", sin)
    if positions.dtype.is_floating_point or positions.dtype.is_complex or \
            positions.dtype == torch.bool:
        raise ValueError(f"positions must be integers, got {positions.dtype}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != head_dim or table.stride(1) != 1:
            raise ValueError(f"{name} must be [max_position, {head_dim}] with unit stride "
                             f"along the last dimension, got {tuple(table.shape)}")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"q and k need unit stride along head_dim, got {q.stride()}, "
                         f"{k.stride()}")
    _check_device(positions, q, k, cos, sin)
    if n_tok == 0 or head_dim == 0 or n_q_heads + n_k_heads == 0:
        return q, k
    half = head_dim // 2
    block_half = next_power_of_2(half)
    block_h = min(next_power_of_2(max(n_q_heads, n_k_heads)),
                  max(1, _ROPE_TILE // block_half))
    grid = (n_tok, cdiv(n_q_heads, block_h) + cdiv(n_k_heads, block_h))
    _rotary_kernel[grid](positions, q, k, cos, sin,
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                         cos.stride(0), sin.stride(0), n_q_heads, n_k_heads, half,
                         BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4,
                         enable_fp_fusion=False)
    return q, k
