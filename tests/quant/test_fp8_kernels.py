"""FP8 kernels (``manylora.ops.quant.fp8_kernels``) against float64 references written from
the published rules (``s = amax / 448``, e4m3fn clamped to ±448; DeepSeek-V3's block-wise
product). The Triton block kernel runs under ``TRITON_INTERPRET=1`` on CPU (tests/conftest.py
sets it; the interpreter loads float8_e4m3fn tensors) and natively on a GPU."""

from __future__ import annotations

import pytest
import torch

from manylora.ops.quant.fp8_kernels import (
    FP8_MAX,
    block_matmul,
    block_matmul_reference,
    quantize_per_token,
    quantize_per_token_group,
    quantize_static,
    scaled_mm,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ref_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.double() / scale.double()).clamp(-448, 448).to(torch.float8_e4m3fn)


def test_per_token_scales_are_row_amax_over_448_and_dequantize_close():
    x = torch.randn(7, 48, generator=torch.Generator().manual_seed(0)) * 5
    x[3] = 0.0
    q, s = quantize_per_token(x)
    amax = x.double().abs().amax(dim=1, keepdim=True)
    assert torch.allclose(s.double()[amax > 0], (amax / FP8_MAX)[amax > 0])
    assert q.dtype == torch.float8_e4m3fn and s.shape == (7, 1)
    assert torch.equal(q[3].float(), torch.zeros(48))
    assert torch.equal(q.float(), _ref_quant(x, s).float())
    # e4m3 keeps 3 mantissa bits: relative error ≤ 2⁻⁴ per element of the row's scale
    assert ((q.double() * s.double() - x.double()).abs() <= s.double() * 448 / 16).all()


def test_per_token_group_scales_cover_a_short_last_group():
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    q, s = quantize_per_token_group(x, 16)
    assert s.shape == (3, 3)
    for g, (lo, hi) in enumerate([(0, 16), (16, 32), (32, 40)]):
        amax = x[:, lo:hi].double().abs().amax(dim=1)
        assert torch.allclose(s[:, g].double(), amax / FP8_MAX)
        assert torch.equal(q[:, lo:hi].float(), _ref_quant(x[:, lo:hi], s[:, g:g + 1]).float())


def test_static_scale_clamps_to_448():
    x = torch.tensor([[1.0, -1000.0, 3.0]])
    q = quantize_static(x, torch.tensor([0.5]))
    assert q.float().tolist() == [[2.0, -448.0, 6.0]]


def test_scaled_mm_matches_dequantized_float64_product():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 32, generator=gen), torch.randn(48, 32, generator=gen)
    xq, sx = quantize_per_token(x)
    wq, sw = quantize_per_token(w)
    ref = (xq.double() * sx.double()) @ (wq.double() * sw.double()).t()
    out = scaled_mm(xq.to(DEVICE), sx.to(DEVICE), wq.to(DEVICE), sw.squeeze(1).to(DEVICE),
                    torch.float32)
    assert torch.allclose(out.double().cpu(), ref, rtol=1e-2 if DEVICE == "cuda" else 1e-5,
                          atol=1e-3)


@pytest.mark.parametrize("m,n,k,bk", [(1, 40, 64, 32), (19, 72, 80, 16), (3, 64, 128, 128)])
def test_block_matmul_triton_matches_float64_reference(m, n, k, bk):
    """Ragged M, N and a K that is not a multiple of the block (masked last block)."""
    gen = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.1
    xq, sx = quantize_per_token_group(x, bk)
    wq, sw = quantize_per_token_group(w, bk)   # one scale per row and K block
    ref = block_matmul_reference(xq, sx, wq, sw, bk)
    out = block_matmul(xq.to(DEVICE), sx.to(DEVICE), wq.to(DEVICE), sw.to(DEVICE), bk,
                       torch.float32)
    assert torch.allclose(out.double().cpu(), ref, rtol=1e-4, atol=1e-4)


def test_block_matmul_refuses_a_block_triton_cannot_tile():
    x = torch.zeros(1, 24, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="power-of-two"):
        block_matmul(x, torch.ones(1, 1), x, torch.ones(1, 1), 24, torch.float32)
