"""The skinny projection kernel (``ops.triton_skinny``) against a float64 reference, its
launch table, and the dense linear method's choice between it and cuBLAS.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` (tests/conftest.py); on a GPU
(``gpu``) it runs for every measured shape and row bucket, also inside a CUDA graph.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from manylora.ops.linear_method import UnquantizedLinearMethod
from manylora.ops.triton_skinny import (
    ROW_BUCKETS,
    SKINNY_CONFIGS,
    SKINNY_MAX_ROWS,
    row_bucket,
    skinny_config,
    skinny_eligible,
    skinny_linear,
)

DENSE = UnquantizedLinearMethod()


def base_linear(x, w, b=None):
    """The dense linear method's product over a layer holding ``w``."""
    return DENSE.apply(SimpleNamespace(weight=w), x, b)


def _reference(x, w, b):
    ref = x.double() @ w.double().T
    return ref if b is None else ref + b.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, n, k, bias", [(1, 48, 128, False), (7, 130, 256, True),
                                              (16, 96, 128, False), (33, 64, 256, True),
                                              (64, 33, 128, False)])
def test_kernel_matches_float64(dtype, rows, n, k, bias):
    """N not a multiple of BLOCK_N, rows not a multiple of BLOCK_M, with and without bias;
    bfloat16 within one rounding of the float64 product."""
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    y = skinny_linear(x, w, b, (row_bucket(rows), 32, 128, 4, 3))
    ref = _reference(x, w, b)
    assert y.dtype == dtype and y.shape == (rows, n)
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
    else:
        # one bfloat16 rounding of a float32 sum (half an ulp, 2^-8 relative, on a GPU; a
        # whole ulp here: Triton's interpreter truncates float32 → bfloat16), plus the
        # float32 accumulation's own error
        assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-3).all()


def test_rows_with_a_stride_and_the_bucket_boundaries():
    x = torch.randn(20, 256)[::2]                     # rows 512 elements apart
    w = torch.randn(40, 256)
    y = skinny_linear(x, w, None, (16, 32, 128, 4, 3))
    torch.testing.assert_close(y.double(), _reference(x, w, None), rtol=1e-5, atol=1e-4)
    assert [row_bucket(r) for r in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]


def test_bad_operands_are_named():
    w = torch.randn(32, 256)
    with pytest.raises(ValueError, match="BLOCK_K"):
        skinny_linear(torch.randn(2, 256), w, None, (16, 32, 512, 4, 3))   # 512 ∤ 256
    with pytest.raises(ValueError, match="BLOCK_M"):
        skinny_linear(torch.randn(20, 256), w, None, (16, 32, 128, 4, 3))
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(torch.randn(2, 256), w, torch.randn(31), (16, 32, 128, 4, 3))
    with pytest.raises(ValueError, match="no launch config"):
        skinny_linear(torch.randn(2, 256), w)                 # an unmeasured shape


def test_launch_table_is_consistent():
    assert SKINNY_CONFIGS, "measured entries"
    for (block_m, _, k), config in SKINNY_CONFIGS.items():
        assert block_m in ROW_BUCKETS and block_m <= SKINNY_MAX_ROWS
        if config is not None:
            block_n, block_k, warps, stages = config
            assert k % block_k == 0 and block_n >= 16 and warps in (1, 2, 4, 8) and stages >= 1
    assert skinny_config(1, 6144, 4096) == (16, *SKINNY_CONFIGS[(16, 6144, 4096)])
    assert skinny_config(40, 4096, 4096) is None            # cuBLAS measured faster
    assert skinny_config(1, 1000, 4096) is None             # not measured


def test_dense_method_uses_cublas_off_cuda():
    """On the CPU (and for float32, many rows or unmeasured shapes) the projection is
    PyTorch's linear, bit for bit."""
    x, w, b = torch.randn(3, 4096), torch.randn(6144, 4096), torch.randn(6144)
    assert not skinny_eligible(x, w)
    assert torch.equal(base_linear(x, w, b), torch.nn.functional.linear(x, w, b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_measured_shapes_match_and_capture():
    """Every measured (bucket, shape) the table sends to the kernel, at the bucket's
    smallest and largest row counts, against float64; the dense method captured in a CUDA
    graph runs it (replayed on new inputs: equal to the kernel called directly), and eagerly
    runs cuBLAS."""
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    for (block_m, n, k), config in SKINNY_CONFIGS.items():
        if config is None:
            continue
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) / 64
        lo = 1 if block_m == ROW_BUCKETS[0] else ROW_BUCKETS[ROW_BUCKETS.index(block_m) - 1] + 1
        for rows in (lo, block_m):
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=gen)
            assert skinny_eligible(x, w)
            ref = _reference(x, w, None)
            y = skinny_linear(x, w)
            assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-2).all(), (rows, n, k)
            assert torch.equal(base_linear(x, w), torch.nn.functional.linear(x, w))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = base_linear(x, w)
            x.copy_(torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=gen))
            graph.replay()
            torch.testing.assert_close(out, skinny_linear(x, w), rtol=0, atol=0)
