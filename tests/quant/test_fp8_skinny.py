"""The skinny FP8 W8A8 kernel (``manylora.ops.quant.fp8_skinny``) against a float64
evaluation of its two formulas (per-row scales; per-(row, K-block) scales), on e4m3fn codes
and scales drawn here, under Triton's interpreter on CPU and on the GPU.

Both sides multiply the same codes; the kernel accumulates and rounds once to the output
dtype, so the error is that rounding (at most ``2u`` relative, ``u`` = 2⁻⁸ for bfloat16: the
interpreter's stores truncate) plus the sums'. Under the interpreter those are float32 (``K ·
2⁻²⁴`` relative at most, K ≤ 1,000). Hopper's FP8 tensor cores keep only about 14 mantissa
bits while they accumulate (DeepSeek-V3 technical report, section 3.3.2), which per-row
scales chain over all of K and block scales over one K block: on the GPU a sum of K
random-signed products is allowed ``4 √K · 2⁻¹⁴``. Asserted elementwise against ``|y|_max``
of the row, with a factor 1.1 over ``2u`` for bfloat16 output and 1.5 over the sums' bound
for float32. The kernel's own quantization of 16-bit rows is checked bit for bit against
``fp8_act_quant`` followed by the product. On CPU the kernel is also compiled for sm_90 at
every launch class the linear method uses, within the H100's shared memory.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from manylora.ops.quant.fp8_kernels import FP8_DTYPE, expand_columns
from manylora.ops.quant.fp8_skinny import (
    FP8_SKINNY_MAX_ROWS,
    fp8_skinny_config,
    fp8_skinny_linear,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _codes(gen, *shape):
    return (torch.randn(*shape, generator=gen) * 64).clamp(-448, 448).to(FP8_DTYPE)


def _operands(m, n, k, block_k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xq, wq = _codes(gen, m, k), _codes(gen, n, k)
    groups = 1 if block_k is None else -(-k // block_k)
    sx = torch.rand(m, groups, generator=gen) * 1e-2 + 1e-3
    sw = torch.rand(n, groups, generator=gen) * 1e-2 + 1e-3
    if block_k is None:
        sw = sw[:, 0]
    bias = torch.randn(n, generator=gen)
    return [a.to(DEVICE) for a in (xq, sx, wq, sw, bias)]


def _reference(xq, sx, wq, sw, bias, block_k):
    x, w = xq.double().cpu(), wq.double().cpu()
    sx, sw = sx.double().cpu(), sw.double().cpu()
    if block_k is None:
        y = sx * (x @ w.T) * sw[None, :]
    else:
        k = x.shape[1]
        y = (x * expand_columns(sx, block_k, k)) @ (w * expand_columns(sw, block_k, k)).T
    return y + bias.double().cpu()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m", [1, 17, FP8_SKINNY_MAX_ROWS])
@pytest.mark.parametrize("n,k,block_k", [(96, 512, None), (70, 1000, None), (64, 384, 128),
                                         (50, 200, 64), (128, 1024, 256)])
def test_matches_float64(m, n, k, block_k, dtype):
    xq, sx, wq, sw, bias = _operands(m, n, k, block_k, seed=m + n)
    config = None
    if block_k is None and DEVICE.type == "cpu":
        block_m, _, _, warps, stages, per_sm = fp8_skinny_config(m, None)
        config = (block_m, 32, 128, warps, stages, per_sm)  # the interpreter: smaller tiles
    y = fp8_skinny_linear(xq, sx, wq, sw, dtype, block_k, bias, config=config)
    want = _reference(xq, sx, wq, sw, bias, block_k)
    assert y.dtype == dtype and y.shape == (m, n)
    sums = 4 * k ** 0.5 * 2.0 ** -14 if DEVICE.type == "cuda" else 1000 * 2.0 ** -24
    bound = 1.1 * 2 * 2.0 ** -8 + sums if dtype == torch.bfloat16 else 1.5 * sums
    err = (y.double().cpu() - want).abs() / want.abs().amax(dim=1, keepdim=True)
    assert err.max().item() <= bound, f"error {err.max().item():.3g} > {bound:.3g}"


@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize("block_k", [None, 64])
def test_split_k_sums_every_part_once(splits, block_k):
    """K split over programs: the last split to finish sums the partials and adds the bias
    once; a second launch finds the arrival counters reset."""
    for seed in (0, 1):
        xq, sx, wq, sw, bias = _operands(3, 40, 448, block_k, seed=seed)
        config = (16, 32, 64, 4, 2, 4)
        y = fp8_skinny_linear(xq, sx, wq, sw, torch.float32, block_k, bias, config=config,
                              splits=splits)
        want = _reference(xq, sx, wq, sw, bias, block_k)
        sums = 4 * 448 ** 0.5 * 2.0 ** -14 if DEVICE.type == "cuda" else 1000 * 2.0 ** -24
        err = (y.double().cpu() - want).abs() / want.abs().amax(dim=1, keepdim=True)
        assert err.max().item() <= 1.5 * sums


def test_mismatched_operands_are_named():
    xq, sx, wq, sw, bias = _operands(4, 64, 256, 128)
    with pytest.raises(ValueError, match="fp8_skinny_linear"):
        fp8_skinny_linear(xq, sx, wq, sw[:, :1], torch.bfloat16, 128)
    with pytest.raises(ValueError, match="fp8_skinny_linear"):
        fp8_skinny_linear(xq.float(), sx, wq, sw, torch.bfloat16, 128)
    with pytest.raises(ValueError, match="fp8_skinny_linear"):
        fp8_skinny_linear(torch.cat([xq] * 20), sx, wq, sw, torch.bfloat16, 128)


_COMPILE_FOR_H100 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from manylora.ops.quant.fp8_skinny import _fp8_skinny_kernel, fp8_skinny_config

    sig = {n: "i32" for n in ("M", "N", "K", "STEPS_PER_SPLIT", "stride_xm", "stride_wn",
                              "stride_ym", "stride_sxm", "stride_swn")}
    sig.update(x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", sx_ptr="*fp32", sw_ptr="*fp32",
               b_ptr="*bf16", ws_ptr="*fp32", count_ptr="*i32", y_ptr="*bf16")
    for rows in (1, 17, 33):
        for block_k in (None, 128):
            bm, bn, bk, warps, stages, _ = fp8_skinny_config(rows, block_k)
            consts = {"BLOCK_SCALES": block_k is not None, "HAS_BIAS": False,
                      "SPLIT": True, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
            kernel = triton.compile(
                ASTSource(_fp8_skinny_kernel, {**sig, **{c: "constexpr" for c in consts}},
                          consts, {}), target=GPUTarget("cuda", 90, 32),
                options={"num_warps": warps, "num_stages": stages})
            ptx = kernel.asm["ptx"]
            assert "e4m3" in ptx and ("mma" in ptx or "wgmma" in ptx), (rows, block_k)
            assert kernel.metadata.shared <= 227 * 1024, (rows, block_k, kernel.metadata.shared)
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernel itself")
def test_kernel_compiles_for_h100(compile_for_h100):
    compile_for_h100(_COMPILE_FOR_H100)
