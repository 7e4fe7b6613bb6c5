"""FP8 activation quantization in one Triton launch: per token, per token group, or by a given
(static) scale.

The torch functions of ``manylora.ops.quant.fp8_kernels`` (``quantize_per_token``,
``quantize_per_token_group``, ``quantize_static``) state the semantics and are the CPU path
and the tests' reference; on CUDA they cost six to twelve small launches each, which a decode
step pays for every quantized projection. This kernel computes the same values in one
launch: program ``(t, g)`` takes row ``t``'s columns ``[g G, (g + 1) G)`` (``G = K`` per
token), and with ``a = max_k |x[t, k]|`` over them::

    s[t, g] = max(a / 448, 1e-12)          (or the given static scale)
    q[t, k] = e4m3(clamp(x[t, k] / s[t, g], -448, 448))

in float32, the divisions correctly rounded (``div_rn``, as torch's), the conversion to
e4m3fn rounding to nearest even on the GPU (``cvt.rn``). Under ``TRITON_INTERPRET=1`` the
scales are the same, but the interpreter's emulation of the e4m3fn conversion does not round
as the hardware does (it loses mantissa bits of small values): the codes hold on the GPU
only. No host synchronisation: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from manylora.ops.host_math import cdiv, next_power_of_2
from manylora.ops.quant.fp8_kernels import FP8_DTYPE, FP8_MAX, MIN_SCALE

#: Columns one step of a program's loops loads.
_MAX_BLOCK = 1024


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_xt, stride_qt,
                     G: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr,
                     QMAX: tl.constexpr, SMIN: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    col0 = g * G
    x_row = x_ptr + t * stride_xt + col0
    if HAS_SCALE:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for c in tl.static_range(0, G, BLOCK):
            mask = (c + offs < G) & (col0 + c + offs < K)
            v = tl.load(x_row + c + offs, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), QMAX), SMIN)
        tl.store(s_ptr + t * tl.num_programs(1) + g, scale)
    q_row = q_ptr + t * stride_qt + col0
    for c in tl.static_range(0, G, BLOCK):
        mask = (c + offs < G) & (col0 + c + offs < K)
        v = tl.load(x_row + c + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -QMAX), QMAX)
        tl.store(q_row + c + offs, v.to(tl.float8e4nv), mask=mask)


def quantize_activations(x: torch.Tensor, group: int | None = None,
                         scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` → ``(q [T, K] e4m3fn, s)`` in one launch (module formula).

    Args:
        x: float32 / bfloat16 / float16 ``[T, K]``, unit stride along ``K``.
        group: columns per scale (``s [T, ceil(K / group)]``), or None: one per row
            (``s [T, 1]``).
        scale: a static per-tensor scale (0-d or ``[1]`` float32): ``s`` is it, expanded to
            ``[T, 1]`` (``group`` must be None).

    Returns:
        ``q`` and float32 ``s`` as ``quantize_per_token`` / ``quantize_per_token_group`` /
        ``quantize_static`` give them.

    Raises:
        ValueError: a ``group`` below 1, ``group`` with ``scale``, or ``x`` not 2-D with unit
            column stride.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_activations: x must be [T, K] with unit column stride, "
                         f"got {tuple(x.shape)} (strides {x.stride()})")
    if group is not None and (group < 1 or scale is not None):
        raise ValueError(f"quantize_activations: group {group} (≥ 1, and not with a static "
                         f"scale)")
    t, k = x.shape
    width = k if group is None else min(group, k)
    groups = cdiv(k, width) if k else 0
    q = torch.empty(t, k, dtype=FP8_DTYPE, device=x.device)
    if scale is not None:
        s = scale.reshape(1, 1).float().expand(t, 1)
    else:
        s = torch.empty(t, max(groups, 1), dtype=torch.float32, device=x.device)
    if t == 0 or k == 0:
        return q, s if scale is not None else s.fill_(MIN_SCALE)
    static = s if scale is None else scale.reshape(1).float()
    _quantize_kernel[(t, groups)](
        x, q, s, static, k, x.stride(0), q.stride(0), G=width, HAS_SCALE=scale is not None,
        BLOCK=min(next_power_of_2(width), _MAX_BLOCK), QMAX=FP8_MAX, SMIN=MIN_SCALE,
        num_warps=4)
    return q, s
