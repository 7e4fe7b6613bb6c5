"""``quantize_activations`` (one Triton launch) against the torch quantizers it replaces on
CUDA (``fp8_kernels.quantize_per_token`` / ``_group`` / ``quantize_static``).

The reference runs on CPU copies: there torch divides correctly rounded and converts to
e4m3fn rounding to nearest even, the semantics the kernel states (on CUDA torch divides a
tensor by a Python number through its reciprocal, off by an ulp at times). The scales must be
equal bit for bit, under Triton's interpreter on CPU and on the GPU. The e4m3fn codes are
compared on the GPU only, where they must all be equal: the interpreter's emulation of the
float32 → e4m3fn conversion does not round as the hardware's ``cvt.rn`` does (it loses
mantissa bits of small values), so on CPU the kernel is also compiled for sm_90 and its
division and conversion checked to be ``div.rn`` and ``cvt.rn``.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from manylora.ops.quant.fp8_act_quant import quantize_activations
from manylora.ops.quant.fp8_kernels import (
    quantize_per_token,
    quantize_per_token_group,
    quantize_static,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _x(t, k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen) * torch.logspace(-3, 3, k)[torch.randperm(k,
                                                                                 generator=gen)]
    x[0, : k // 2] = 0                      # a half-zero row, and below an all-zero group
    if t > 1:
        x[1] = 0
    return x.to(dtype).to(DEVICE)


def _assert_codes(q, want):
    """On the GPU, ``q == want`` code for code (module docstring)."""
    if DEVICE.type == "cuda":
        differ = q.cpu().view(torch.uint8) != want.view(torch.uint8)
        assert not differ.any(), f"{int(differ.sum())} codes differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("t,k,group", [(1, 4096, None), (3, 300, None), (5, 300, 128),
                                       (2, 1024, 128), (4, 2000, 1024), (3, 40, 64)])
def test_matches_torch_quantizers(t, k, group, dtype):
    x = _x(t, k, dtype, seed=k)
    q, s = quantize_activations(x, group)
    cpu = x.cpu()
    want, want_s = (quantize_per_token(cpu) if group is None
                    else quantize_per_token_group(cpu, group))
    assert q.dtype == torch.float8_e4m3fn and q.shape == (t, k)
    assert s.dtype == torch.float32 and torch.equal(s.cpu(), want_s)
    _assert_codes(q, want)


def test_static_scale():
    x = _x(6, 512, torch.bfloat16)
    scale = torch.tensor(0.03, device=DEVICE)
    q, s = quantize_activations(x, scale=scale)
    assert s.shape == (6, 1) and bool((s == scale).all())
    _assert_codes(q, quantize_static(x.cpu(), scale.cpu()))


def test_refusals_name_the_problem():
    x = _x(2, 64, torch.float32)
    with pytest.raises(ValueError, match="group 0"):
        quantize_activations(x, 0)
    with pytest.raises(ValueError, match="static"):
        quantize_activations(x, 32, scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match="unit column stride"):
        quantize_activations(x.t())


_COMPILE_FOR_H100 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from manylora.ops.quant.fp8_act_quant import _quantize_kernel

    for dtype in ("fp32", "bf16", "fp16"):
        for static in (False, True):
            sig = {"x_ptr": f"*{dtype}", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                   "static_ptr": "*fp32", "K": "i32", "stride_xt": "i32", "stride_qt": "i32"}
            consts = {"G": 4096, "HAS_SCALE": static, "BLOCK": 1024, "QMAX": 448.0,
                      "SMIN": 1e-12}
            sig.update({name: "constexpr" for name in consts})
            ptx = triton.compile(ASTSource(_quantize_kernel, sig, consts, {}),
                                 target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": 4}).asm["ptx"]
            assert "cvt.rn.satfinite.e4m3x2.f32" in ptx, (dtype, static)
            assert "div.rn.f32" in ptx, (dtype, static)
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernel itself")
def test_kernel_compiles_for_h100_with_round_to_nearest(compile_for_h100):
    compile_for_h100(_COMPILE_FOR_H100)
