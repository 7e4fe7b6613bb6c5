"""The W4A16 kernels (``manylora.ops.quant.w4a16``) against a float64 dequantize-then-multiply
of the same codes, scales and zero points.

On CPU they run under Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``), on CUDA when there is a GPU. Shapes are odd on purpose (N and K not
multiples of the blocks, a last group shorter than the rest), groups of 32, 64, 128 and one
over K, of 12 rows (not a whole word), activation-order groups through ``g_idx``; up to 64
rows take the split-K kernel and 65 rows the unsplit GEMM. The bound is the float32
accumulation's plus one rounding of the output and, on a GPU, of the dequantized weight to
the activation dtype: ``(2u + K·2⁻²⁴) · (|x| · |W|)`` per element, ``u`` the dtype's unit
roundoff.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from manylora.ops.quant.w4a16 import (
    DECODE_MAX_ROWS,
    dequantize,
    pack_planes,
    pack_rows,
    unpack_planes,
    unpack_rows,
    w4a16_gemm,
    w4a16_gemv,
    w4a16_linear,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _operands(n, k, group, dtype, act_order, seed=0):
    gen = torch.Generator().manual_seed(seed)
    size = k if group == -1 else group
    groups = -(-k // size)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.1 + 0.01).to(dtype)
    zeros = torch.randint(0, 16, (groups, n), generator=gen).to(dtype)
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // size)[torch.randperm(k, generator=gen)].to(torch.int32)
    x = torch.randn(80, k, generator=gen).to(dtype)
    return (x.to(DEVICE), pack_planes(q).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE),
            None if g_idx is None else g_idx.to(DEVICE), size, q)


def _reference(x, q, scales, zeros, g_idx, size):
    k = q.shape[0]
    groups = (torch.arange(k) // size) if g_idx is None else g_idx.cpu().long()
    w = (q.double() - zeros.cpu().double()[groups]) * scales.cpu().double()[groups]
    x = x.cpu().double()
    return x @ w, x.abs() @ w.abs()


def _assert_close(y, x, q, scales, zeros, g_idx, size):
    ref, mag = _reference(x, q, scales, zeros, g_idx, size)
    assert y.dtype == x.dtype and y.shape == ref.shape
    bound = (2 * UNIT[x.dtype] + q.shape[0] * 2.0 ** -24) * mag + 1e-30
    err = (y.cpu().double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max().item()} over bound {bound.min().item()}"


def test_pack_planes_round_trips_and_puts_row_jp_plus_i_in_nibble_j():
    q = torch.randint(0, 16, (20, 5), generator=torch.Generator().manual_seed(1))
    packed = pack_planes(q)                           # P = 3 words per column
    assert packed.shape == (3, 5) and packed.dtype == torch.int32
    assert torch.equal(unpack_planes(packed, 20), q.to(torch.int32))
    word = int(packed[1, 2]) & 0xFFFFFFFF
    rows = [3 * j + 1 for j in range(8)]              # rows past 19 are zero codes
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == [
        int(q[r, 2]) if r < 20 else 0 for r in rows]


def test_pack_rows_round_trips_and_puts_row_8i_plus_j_in_nibble_j():
    q = torch.randint(0, 16, (20, 5), generator=torch.Generator().manual_seed(1))
    packed = pack_rows(q)
    assert packed.shape == (3, 5) and packed.dtype == torch.int32
    assert torch.equal(unpack_rows(packed, 20), q.to(torch.int32))
    word = int(packed[1, 2]) & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == q[8:16, 2].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k, group, act_order", [
    (70, 136, 32, False),      # N, K off the blocks; K not a multiple of the group
    (48, 200, 64, True),       # activation order: rows' groups through g_idx
    (130, 256, 128, False),
    (24, 96, -1, False),       # one group over K
    (20, 60, 12, False),       # groups that split a word: per-row groups
])
@pytest.mark.parametrize("rows", [1, 3, 17, 65])
def test_w4a16_linear_matches_float64_dequantized_product(dtype, n, k, group, act_order, rows):
    x, qweight, scales, zeros, g_idx, size, q = _operands(n, k, group, dtype, act_order)
    y = w4a16_linear(x[:rows], qweight, scales, zeros, g_idx, size)
    _assert_close(y, x[:rows], q, scales, zeros, g_idx, size)


@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("config", [(16, 32, 16, 4, 2, 4), (16, 16, 32, 4, 2, 4)],
                         ids=["kw16", "kw32"])
@pytest.mark.parametrize("k, group", [(328, 128), (512, 32)], ids=["row-groups", "plane-groups"])
def test_gemv_split_k_sums_every_part_once(splits, config, k, group):
    # a short last group, or groups that each plane's steps fall in whole; a second launch
    # finds the arrival counters reset
    x, qweight, scales, zeros, g_idx, size, q = _operands(40, k, group, torch.float32, False)
    for part in (x[:3], x[-16:]):
        y = w4a16_gemv(part, qweight, scales, zeros, g_idx, size, splits=splits,
                       config=config)
        _assert_close(y, part, q, scales, zeros, g_idx, size)


@pytest.mark.parametrize("rows", [2, 65])
def test_bias_is_added_before_the_rounding(rows):
    x, qweight, scales, zeros, g_idx, size, q = _operands(24, 64, 32, torch.bfloat16, False)
    bias = torch.linspace(-4, 4, 24, dtype=torch.bfloat16, device=DEVICE)
    y = w4a16_linear(x[:rows], qweight, scales, zeros, g_idx, size, bias)
    ref, mag = _reference(x[:rows], q, scales, zeros, g_idx, size)
    ref = ref + bias.cpu().double()
    bound = (2 * UNIT[torch.bfloat16] + 64 * 2.0 ** -24) * (mag + bias.cpu().double().abs())
    assert ((y.cpu().double() - ref).abs() <= bound).all()


def test_gemm_takes_decode_rows_too_and_gemv_refuses_prefill_rows():
    x, qweight, scales, zeros, g_idx, size, q = _operands(32, 64, 32, torch.float32, False)
    _assert_close(w4a16_gemm(x[:2], qweight, scales, zeros, g_idx, size), x[:2], q, scales,
                  zeros, g_idx, size)
    with pytest.raises(ValueError, match=f"at most {DECODE_MAX_ROWS}"):
        w4a16_gemv(x[:DECODE_MAX_ROWS + 1], qweight, scales, zeros, g_idx, size)
    with pytest.raises(ValueError, match="BLOCK_M of 16"):
        w4a16_gemv(x[:17], qweight, scales, zeros, g_idx, size,
                   config=(16, 32, 16, 4, 2, 4))


def test_torch_reference_dequantizes_by_the_module_formula():
    x, qweight, scales, zeros, g_idx, size, q = _operands(16, 40, -1, torch.float32, False)
    w = dequantize(qweight.cpu(), scales.cpu().double(), zeros.cpu().double(), None, size, 40)
    assert torch.equal(w, (q.double() - zeros.cpu().double()[0]) * scales.cpu().double()[0])


def test_mismatched_operands_are_named():
    x, qweight, scales, zeros, g_idx, size, q = _operands(16, 64, 32, torch.float32, False)
    with pytest.raises(ValueError, match="qweight"):
        w4a16_linear(x[:, :56], qweight, scales, zeros, None, size)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, DECODE_MAX_ROWS, 72])
def test_w4a16_linear_replays_in_a_cuda_graph(rows):
    """Both kernels launch without host syncs: captured once, replayed on new inputs."""
    x, qweight, scales, zeros, g_idx, size, q = _operands(256, 512, 128, torch.bfloat16, True)
    static = x[:rows].clone()
    w4a16_linear(static, qweight, scales, zeros, g_idx, size)      # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w4a16_linear(static, qweight, scales, zeros, g_idx, size)
    static.copy_(x[-rows:])
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(y, x[-rows:], q, scales, zeros, g_idx, size)


_COMPILE_FOR_H100 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from manylora.ops.quant.w4a16 import DECODE_CONFIGS, GEMM_CONFIG, _w4a16_kernel

    sig = {n: "i32" for n in ("M", "N", "K", "PLANE", "STEPS_PER_SPLIT", "stride_xm",
                              "stride_ym")}
    sig.update(x_ptr="*bf16", q_ptr="*i32", s_ptr="*bf16", z_ptr="*bf16", g_ptr="*i32",
               b_ptr="*bf16", ws_ptr="*fp32", count_ptr="*i32", y_ptr="*bf16")
    cases = [(*c[:5], True) for c in DECODE_CONFIGS.values()]
    cases.append((*GEMM_CONFIG, False))
    for block_m, block_n, block_kw, warps, stages, split in cases:
        for mode, even, dtype in (((0, True, "bf16"), (0, False, "fp16"), (1, False, "bf16"),
                                   (2, True, "fp16")) if block_m == 16
                                  else ((0, True, "bf16"),)):
            typed = {**sig, **{p: f"*{dtype}" for p in ("x_ptr", "s_ptr", "z_ptr", "b_ptr",
                                                          "y_ptr")}}
            consts = {"GROUP_SIZE": 128 if mode == 0 else 32, "MODE": mode,
                      "HAS_BIAS": mode == 1, "SPLIT": split, "DOT_FP32": False,
                      "IEEE": False, "EVEN": even, "BLOCK_M": block_m,
                      "BLOCK_N": block_n, "BLOCK_KW": block_kw}
            kernel = triton.compile(
                ASTSource(_w4a16_kernel, {**typed, **{c: "constexpr" for c in consts}},
                          consts, {}), target=GPUTarget("cuda", 90, 32),
                options={"num_warps": warps, "num_stages": stages})
            assert "mma" in kernel.asm["ptx"], (block_m, mode)
            assert "prmt.b32" in kernel.asm["ptx"], (block_m, mode)     # the packed dequant
            assert kernel.metadata.shared <= 227 * 1024, (block_m, mode)
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernel itself")
def test_kernel_compiles_for_h100(compile_for_h100):
    """Every decode bucket's and prefill's config builds for sm_90 on tensor cores, the
    16-row one in each group layout."""
    compile_for_h100(_COMPILE_FOR_H100)
