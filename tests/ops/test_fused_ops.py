"""The fused Triton kernels of ``manylora.ops.triton_fused`` against the PyTorch formulas.

The kernels run on CUDA when there is a GPU and otherwise on CPU tensors under Triton's
interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``). Inputs are seeded random
values (never zeros); every output buffer is poisoned with NaN first, so an element the kernel
does not write fails the test. Each op is compared with

(a) the PyTorch formula in the same dtype (HF transformers' Llama rounding):

* RoPE and the residual add of ``fused_add_rms_norm``: bit-exact (``torch.equal``) in every
  dtype. Each step is one IEEE operation on the same operands, rounded to nearest-even in the
  same order; the kernels turn FMA contraction off, and no transcendental or reduction is
  involved.
* RMSNorm and SiLU-and-mul in bfloat16 / float16: exact, except where a float32 value that
  PyTorch computes differently in the last bits (the sum of squares, in a different order;
  ``exp`` / ``rsqrt`` of another math library) straddles a rounding boundary of the one
  intermediate rounded to the dtype (the normalized ``x``; ``silu(gate)``). That intermediate
  is then the neighbouring value (one ulp away), and the output is exactly the product with it.
  Asserted: every output element equals ``weight * n`` (``n * up``) for ``n`` the PyTorch
  intermediate or one of its two neighbours, and fewer than 0.1% of the elements differ from
  PyTorch at all (measured on the interpreter over 300k elements: bfloat16 none; float16
  5e-5 of them for RMSNorm, 2e-4 for SiLU-and-mul). A neighbouring intermediate can move the
  output by up to 2 ulps, so the check is on the intermediate, not a 1-ulp bound on the
  output.
* The same two in float32: nothing is rounded to a narrower type, so the float32 differences
  show directly: elementwise relative error at most 1e-6 (measured: at most 4 float32 ulps,
  4.8e-7).

(b) a float64 evaluation of the formula: the error bound of the roundings the formula makes
(``k`` roundings: ``k * u * |value|``, ``u`` the unit roundoff of the dtype), plus 1e-6
relative for the float32 statistic, plus the dtype's smallest normal for results in the
subnormal range.

Without a GPU one more test compiles the kernels for an H100 (sm_90, no device needed) and
checks the PTX: no FMA contraction in RMSNorm / RoPE, IEEE division, vectorized loads.
"""

from __future__ import annotations

import textwrap
import types
import zlib

import pytest
import torch
import transformers

from manylora.model.layers.activation import SiluAndMul, silu_and_mul
from manylora.model.layers.norm import GemmaRMSNorm, RMSNorm
from manylora.model.layers.rotary import RotaryEmbedding, _rotate_half
from manylora.ops.triton_fused import (
    fused_add_rms_norm_triton,
    rms_norm_triton,
    rotary_embedding_triton,
    silu_and_mul_triton,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = ("fp32", "bf16", "fp16")
# unit roundoff (half an ulp of 1.0) and smallest normal of each dtype
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
TINY = {torch.float32: 2.0 ** -126, torch.bfloat16: 2.0 ** -126, torch.float16: 2.0 ** -14}
FP32_SLACK = 1e-6           # relative: the float32 statistic / exp of another library
MAX_DIFF_FRACTION = 1e-3    # elements (bfloat16 / float16) off PyTorch by one intermediate ulp
EPS = 1e-5


def _gen(*key: object) -> torch.Generator:
    """A CPU generator seeded from the test's parameters (stable across processes)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Seeded normal values, nonzero, rounded to ``dtype``, on ``DEVICE``."""
    t = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale
    t = torch.where(t.abs() < 1e-3, torch.full_like(t, 0.5), t)
    return t.to(dtype).to(DEVICE)


def _nan(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def _neighbours(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two values one ulp away from each element of a bfloat16 / float16 tensor."""
    bits = t.view(torch.int16)
    return (bits + 1).view(t.dtype), (bits - 1).view(t.dtype)


def _assert_one_rounding_off(out: torch.Tensor, inter: torch.Tensor, other: torch.Tensor,
                             want: torch.Tensor) -> None:
    """``out`` is ``inter * other`` for ``inter`` or a neighbour of it, and rarely differs from
    ``want`` (= ``inter * other``)."""
    assert not out.isnan().any(), "unwritten (NaN-poisoned) output elements"
    if out.dtype == torch.float32:
        rel = (out.double() - want.double()).abs() / want.double().abs().clamp_min(1e-300)
        assert rel.max().item() <= 1e-6, rel.max().item()
        return
    ok = out == want
    for n in _neighbours(inter):
        ok |= out == n * other
    assert ok.all(), f"{(~ok).sum().item()} elements off by more than one intermediate ulp"
    frac = (out != want).double().mean().item()
    assert frac < MAX_DIFF_FRACTION, frac


def _assert_f64_bound(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    err = (out.double() - ref).abs()
    excess = err - bound
    assert (excess <= 0).all(), (excess.max().item(), err.max().item())


# ---------------------------------------------------------------------------------------------
# RMSNorm (HF LlamaRMSNorm) and fused_add_rms_norm


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, n)``: HF's formula in the dtype, and its rounded intermediate ``n``."""
    xf = x.float()
    n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * n, n


def _f64_rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = h.double()
    return weight.double() * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize(("n_cols", "block_size"), [(40, None), (200, None), (200, 64)],
                         ids=["n40", "n200", "n200_chunked"])
@pytest.mark.parametrize("n_rows", [1, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm(dtype, n_rows, n_cols, block_size, residual):
    """Hidden sizes that are not a power of two (masked tails); ``block_size=64`` takes the
    chunked two-pass path (4 chunks, the last one partial)."""
    gen = _gen("rms", dtype, n_rows, n_cols, residual)
    x = _randn(gen, n_rows, n_cols, scale=3.0, dtype=dtype)
    weight = (1.0 + _randn(gen, n_cols, scale=0.5)).to(dtype)
    out = _nan((n_rows, n_cols), dtype)
    if residual:
        res = _randn(gen, n_rows, n_cols, scale=3.0, dtype=dtype)
        x_in, res_in = x.clone(), res.clone()
        res_out = _nan((n_rows, n_cols), dtype)
        got, got_res = fused_add_rms_norm_triton(x, res, weight, EPS, out=out,
                                                 residual_out=res_out, block_size=block_size)
        assert got is out and got_res is res_out
        assert torch.equal(x, x_in) and torch.equal(res, res_in)
        h = x + res
        # (a) the residual add is one rounding, as torch's add: exact
        assert torch.equal(got_res, h)
        # (b) and within one rounding of the float64 sum
        h64 = x.double() + res.double()
        _assert_f64_bound(got_res, h64, UNIT[dtype] * h64.abs())
    else:
        got = rms_norm_triton(x, weight, EPS, out=out, block_size=block_size)
        assert got is out
        h = x
    want, n = _torch_rms_norm(h, weight, EPS)
    _assert_one_rounding_off(got, n, weight, want)
    # (b) two roundings (normalized value, product with the weight) + the float32 statistic
    ref = _f64_rms_norm(h, weight, EPS)
    _assert_f64_bound(got, ref, (2 * UNIT[dtype] + FP32_SLACK) * ref.abs())


def _hf_gemma_rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' own ``Gemma2RMSNorm`` on ``h`` (``(1 + w)``, float32, one cast)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    norm = Gemma2RMSNorm(h.shape[-1], eps).to(device=h.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm(h)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("block_size", [None, 64], ids=["one_pass", "chunked"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gemma_rms_norm(dtype, block_size, residual):
    """``unit_offset`` (Gemma's ``(1 + w)`` norm, zero-centred weights) against
    transformers' ``Gemma2RMSNorm``: one rounding of a float32 product, so only the float32
    statistic can move an element, to a neighbouring value, and rarely."""
    gen = _gen("gemma_rms", dtype, block_size, residual)
    x = _randn(gen, 5, 200, scale=3.0, dtype=dtype)
    weight = _randn(gen, 200, scale=0.5).to(dtype)
    out = _nan((5, 200), dtype)
    if residual:
        res = _randn(gen, 5, 200, scale=3.0, dtype=dtype)
        got, got_res = fused_add_rms_norm_triton(x, res, weight, EPS, out=out,
                                                 block_size=block_size, unit_offset=True)
        h = x + res
        assert torch.equal(got_res, h)
    else:
        got = rms_norm_triton(x, weight, EPS, out=out, block_size=block_size,
                              unit_offset=True)
        h = x
    assert got is out and not got.isnan().any()
    want = _hf_gemma_rms_norm(h, weight, EPS)
    if dtype == torch.float32:
        rel = (got.double() - want.double()).abs() / want.double().abs().clamp_min(1e-300)
        assert rel.max().item() <= 1e-6, rel.max().item()
    else:
        ok = (got == want) | (got == _neighbours(want)[0]) | (got == _neighbours(want)[1])
        assert ok.all()
        assert (got != want).double().mean().item() < MAX_DIFF_FRACTION
    h64 = h.double()
    ref = (h64 / torch.sqrt(h64.pow(2).mean(-1, keepdim=True) + EPS)
           * (1.0 + weight.double()))
    _assert_f64_bound(got, ref, (UNIT[dtype] + FP32_SLACK) * ref.abs())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm_in_place_and_default_outputs(dtype):
    """``out=x`` / ``residual_out=residual`` (vLLM's in-place form) and allocated outputs
    give the same values; a wide row (4096, two chunks of 2048) matches too."""
    gen = _gen("rms_inplace", dtype)
    x = _randn(gen, 3, 4096, dtype=dtype)
    res = _randn(gen, 3, 4096, dtype=dtype)
    weight = (1.0 + _randn(gen, 4096, scale=0.5)).to(dtype)
    want_out, want_res = fused_add_rms_norm_triton(x, res, weight, EPS)
    assert want_out.is_contiguous() and want_res.is_contiguous()
    x2, res2 = x.clone(), res.clone()
    got_out, got_res = fused_add_rms_norm_triton(x2, res2, weight, EPS, out=x2,
                                                 residual_out=res2)
    assert got_out is x2 and got_res is res2
    assert torch.equal(got_out, want_out) and torch.equal(got_res, want_res)
    chunked_out, chunked_res = fused_add_rms_norm_triton(x, res, weight, EPS, block_size=2048)
    assert torch.equal(chunked_res, want_res)
    assert torch.equal(want_res, x + res)
    _, n = _torch_rms_norm(want_res, weight, EPS)
    _assert_one_rounding_off(want_out, n, weight, weight * n)
    _assert_one_rounding_off(chunked_out, n, weight, weight * n)
    x3 = x.clone()
    assert rms_norm_triton(x3, weight, EPS, out=x3) is x3
    assert torch.equal(x3, rms_norm_triton(x, weight, EPS))


def test_rms_norm_strided_input_and_float32_weight():
    """Rows with a stride (a column slice of a wider buffer), leading dims, and a float32
    weight on bfloat16 activations (HF promotes: the product is float32)."""
    gen = _gen("rms_mixed")
    buf = _randn(gen, 2, 3, 300, dtype=torch.bfloat16)
    x = buf[..., 50:250]                                      # [2, 3, 200], row stride 300
    weight = 1.0 + _randn(gen, 200, scale=0.5)                # float32
    got = rms_norm_triton(x, weight, EPS)
    assert got.dtype == torch.float32 and got.shape == x.shape
    want, n = _torch_rms_norm(x, weight, EPS)
    assert want.dtype == torch.float32
    ok = got == want
    for nb in _neighbours(n):
        ok |= got == weight * nb
    assert ok.all()


# ---------------------------------------------------------------------------------------------
# SiLU and mul (HF LlamaMLP: act_fn(gate) * up)


@pytest.mark.parametrize("n_inter", [40, 200, 1100])
@pytest.mark.parametrize("n_rows", [1, 6])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_and_mul(dtype, n_rows, n_inter):
    gen = _gen("silu", dtype, n_rows, n_inter)
    x = _randn(gen, n_rows, 2 * n_inter, scale=4.0, dtype=dtype)
    x[0, :4] = torch.tensor([-90.0, -20.0, 20.0, 90.0], dtype=dtype)   # exp over/underflow
    x_in = x.clone()
    out = _nan((n_rows, n_inter), dtype)
    got = silu_and_mul_triton(x, out=out)
    assert got is out and torch.equal(x, x_in)
    gate, up = x[:, :n_inter], x[:, n_inter:]
    s = torch.nn.functional.silu(gate)
    _assert_one_rounding_off(got, s, up, s * up)
    # (b) two roundings (silu, product) + float32 exp; subnormal results absolutely. The
    # formula's exp(-g) is float32: it overflows to inf below g = -88.72 (silu -> -0).
    g64, u64 = gate.double(), up.double()
    e = torch.exp(-g64)
    e = torch.where(e > torch.finfo(torch.float32).max, torch.inf, e)
    ref = g64 / (1 + e) * u64
    bound = (2 * UNIT[dtype] + FP32_SLACK) * ref.abs() + TINY[dtype] * (1 + u64.abs())
    _assert_f64_bound(got, ref, bound)


def test_silu_and_mul_strided_rows_and_leading_dims():
    gen = _gen("silu_strided")
    buf = _randn(gen, 2, 3, 100, dtype=torch.bfloat16)
    x = buf[..., 10:90]                                       # [2, 3, 80], row stride 100
    got = silu_and_mul_triton(x)
    assert got.shape == (2, 3, 40) and got.is_contiguous()
    s = torch.nn.functional.silu(x[..., :40])
    _assert_one_rounding_off(got, s, x[..., 40:], s * x[..., 40:])


# ---------------------------------------------------------------------------------------------
# Rotary embedding (HF apply_rotary_pos_emb), in place on views of a packed qkv


def _rope_config() -> types.SimpleNamespace:
    return types.SimpleNamespace(rope_theta=10000.0)


def _packed_qkv(gen: torch.Generator, n_tok: int, n_q: int, n_kv: int, head_dim: int,
                dtype: torch.dtype, pad: int = 5):
    """``(buf, q, k, v)``: q/k/v views of a ``[T, q + 2 kv + pad]`` buffer whose ``pad``
    trailing columns are NaN (so a stray write or read shows)."""
    q_size, kv_size = n_q * head_dim, n_kv * head_dim
    buf = _nan((n_tok, q_size + 2 * kv_size + pad), dtype)
    buf[:, :q_size + 2 * kv_size] = _randn(gen, n_tok, q_size + 2 * kv_size, dtype=dtype)
    qkv = buf[:, :q_size + 2 * kv_size]
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    return buf, q.view(n_tok, n_q, head_dim), k.view(n_tok, n_kv, head_dim), v


@pytest.mark.parametrize("heads", [(4, 2, 12), (6, 1, 80), (8, 8, 64), (32, 8, 128)],
                         ids=["gqa_d12", "mqa_d80", "mha_d64", "gqa_d128"])
@pytest.mark.parametrize("n_tok", [1, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_embedding(dtype, n_tok, heads):
    n_q, n_kv, head_dim = heads
    gen = _gen("rope", dtype, n_tok, heads)
    max_pos = 300
    rope = RotaryEmbedding(_rope_config(), head_dim, max_pos).to(DEVICE)
    positions = torch.randint(0, max_pos, (n_tok,), generator=gen).to(DEVICE)
    positions[0] = max_pos - 1
    buf, q, k, v = _packed_qkv(gen, n_tok, n_q, n_kv, head_dim, dtype)
    if n_tok > 1:
        assert q.stride(0) != n_q * head_dim and not q.is_contiguous()
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    got_q, got_k = rotary_embedding_triton(positions, q, k, rope.cos, rope.sin)
    assert got_q is q and got_k is k
    assert q.data_ptr() == buf.data_ptr()          # rotated where it lies, in buf
    assert torch.equal(v, v0)
    assert buf[:, -5:].isnan().all()                      # padding untouched
    assert not buf[:, :-5].isnan().any()
    cos = rope.cos[positions].to(dtype)[:, None, :]
    sin = rope.sin[positions].to(dtype)[:, None, :]
    # (a) HF's formula in the dtype: exact
    assert torch.equal(q, q0 * cos + _rotate_half(q0) * sin)
    assert torch.equal(k, k0 * cos + _rotate_half(k0) * sin)
    # (b) three roundings (cos/sin to the dtype, product, sum) of each term, float64
    cos64, sin64 = rope.cos[positions].double()[:, None], rope.sin[positions].double()[:, None]
    for got, x0 in ((q, q0), (k, k0)):
        a, b = x0.double() * cos64, _rotate_half(x0.double()) * sin64
        bound = 3.01 * UNIT[dtype] * (a.abs() + b.abs())
        _assert_f64_bound(got, a + b, bound)


def test_rotary_embedding_int32_positions_and_scaled_table():
    """int32 positions with repeats; a llama3-scaled table (any float32 [P, D] table)."""
    cfg = transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=2, head_dim=64, max_position_embeddings=512,
        rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    rope = RotaryEmbedding(cfg, 64, 512).to(DEVICE)
    gen = _gen("rope_int32")
    positions = torch.tensor([511, 3, 3, 200, 0], dtype=torch.int32, device=DEVICE)
    _, q, k, _ = _packed_qkv(gen, 5, 2, 1, 64, torch.bfloat16)
    q0, k0 = q.clone(), k.clone()
    rotary_embedding_triton(positions, q, k, rope.cos, rope.sin)
    cos = rope.cos[positions.long()].to(torch.bfloat16)[:, None, :]
    sin = rope.sin[positions.long()].to(torch.bfloat16)[:, None, :]
    assert torch.equal(q, q0 * cos + _rotate_half(q0) * sin)
    assert torch.equal(k, k0 * cos + _rotate_half(k0) * sin)


# ---------------------------------------------------------------------------------------------
# the layers, bad input


def test_layers_torch_path_is_hf_formula():
    """On CPU the layers run PyTorch: HF's formulas exactly; inputs other than RoPE's q/k
    are not modified."""
    gen = _gen("layers")
    x = torch.randn(4, 48, generator=gen).to(torch.bfloat16)
    res = torch.randn(4, 48, generator=gen).to(torch.bfloat16)
    x0, res0 = x.clone(), res.clone()
    norm = RMSNorm(48, EPS, torch.bfloat16, torch.device("cpu"))
    norm.weight.copy_(1.0 + 0.5 * torch.randn(48, generator=gen))
    assert torch.equal(norm(x), _torch_rms_norm(x, norm.weight, EPS)[0])
    out, new_res = norm(x, res)
    assert torch.equal(new_res, x + res)
    assert torch.equal(out, _torch_rms_norm(x + res, norm.weight, EPS)[0])
    assert torch.equal(x, x0) and torch.equal(res, res0)
    gemma = GemmaRMSNorm(48, EPS, torch.bfloat16, torch.device("cpu"))
    gemma.weight.copy_(0.5 * torch.randn(48, generator=gen))
    assert torch.equal(gemma(x), _hf_gemma_rms_norm(x, gemma.weight, EPS))
    out, new_res = gemma(x, res)
    assert torch.equal(new_res, x + res)
    assert torch.equal(out, _hf_gemma_rms_norm(x + res, gemma.weight, EPS))

    gu = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    want = torch.nn.functional.silu(gu[:, :32]) * gu[:, 32:]
    assert torch.equal(silu_and_mul(gu), want) and torch.equal(SiluAndMul()(gu), want)

    rope = RotaryEmbedding(_rope_config(), 16, 32)
    _, q, k, _ = _packed_qkv(gen, 3, 4, 2, 16, torch.bfloat16)
    q, k = q.cpu(), k.cpu()
    q0 = q.clone()
    positions = torch.tensor([5, 0, 31])
    got_q, got_k = rope(positions, q, k)
    assert got_q is q and got_k is k
    cos = rope.cos[positions].to(torch.bfloat16)[:, None, :]
    sin = rope.sin[positions].to(torch.bfloat16)[:, None, :]
    assert torch.equal(q, q0 * cos + _rotate_half(q0) * sin)


@pytest.mark.gpu
def test_layers_dispatch_to_triton_on_cuda():
    gen = _gen("layers_cuda")
    x = _randn(gen, 4, 256, dtype=torch.bfloat16)
    res = _randn(gen, 4, 256, dtype=torch.bfloat16)
    norm = RMSNorm(256, EPS, torch.bfloat16, DEVICE)
    norm.weight.copy_(1.0 + _randn(gen, 256, scale=0.5))
    assert torch.equal(norm(x), rms_norm_triton(x, norm.weight, EPS))
    out, new_res = norm(x, res)
    want_out, want_res = fused_add_rms_norm_triton(x, res, norm.weight, EPS)
    assert torch.equal(out, want_out) and torch.equal(new_res, want_res)
    gemma = GemmaRMSNorm(256, EPS, torch.bfloat16, DEVICE)
    gemma.weight.copy_(_randn(gen, 256, scale=0.5))
    assert torch.equal(gemma(x), rms_norm_triton(x, gemma.weight, EPS, unit_offset=True))
    gu = _randn(gen, 4, 512, dtype=torch.bfloat16)
    assert torch.equal(silu_and_mul(gu), silu_and_mul_triton(gu))
    rope = RotaryEmbedding(_rope_config(), 64, 128).to(DEVICE)
    _, q, k, _ = _packed_qkv(gen, 4, 8, 2, 64, torch.bfloat16)
    q2, k2 = q.clone(), k.clone()
    positions = torch.tensor([9, 1, 100, 1], device=DEVICE)
    rope(positions, q, k)
    rotary_embedding_triton(positions, q2, k2, rope.cos, rope.sin)
    assert torch.equal(q, q2) and torch.equal(k, k2)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """All three ops captured in one CUDA graph; a replay on new inputs matches eager runs."""
    gen = _gen("graph")
    dtype = torch.bfloat16
    x, res = _randn(gen, 8, 512, dtype=dtype), _randn(gen, 8, 512, dtype=dtype)
    weight = (1.0 + _randn(gen, 512, scale=0.5)).to(dtype)
    gu = _randn(gen, 8, 2 * 1100, dtype=dtype)
    rope = RotaryEmbedding(_rope_config(), 128, 256).to(DEVICE)
    buf, q, k, _ = _packed_qkv(gen, 8, 8, 2, 128, dtype)
    positions = torch.randint(0, 256, (8,), generator=gen).to(DEVICE)

    def step():
        out, new_res = fused_add_rms_norm_triton(x, res, weight, EPS)
        act = silu_and_mul_triton(gu)
        rotary_embedding_triton(positions, q, k, rope.cos, rope.sin)
        return out, new_res, act

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()                                        # compiles the kernels outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()

    new = _gen("graph_new")
    x.copy_(_randn(new, 8, 512, dtype=dtype))
    res.copy_(_randn(new, 8, 512, dtype=dtype))
    gu.copy_(_randn(new, 8, 2 * 1100, dtype=dtype))
    positions.copy_(torch.randint(0, 256, (8,), generator=new))
    fresh = _randn(new, *buf.shape, dtype=dtype)
    buf.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    got_q, got_k = q.clone(), k.clone()
    buf.copy_(fresh)
    want = step()
    for got, exp in zip(outs, want):
        assert torch.equal(got, exp)
    assert torch.equal(got_q, q) and torch.equal(got_k, k)


def test_bad_input_raises():
    gen = _gen("bad")
    x = _randn(gen, 2, 8)
    w = _randn(gen, 8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, _randn(gen, 7), EPS)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm_triton(x, _randn(gen, 2, 8, dtype=torch.float16), w, EPS)
    with pytest.raises(ValueError, match="power of two"):
        rms_norm_triton(x, w, EPS, block_size=48)
    with pytest.raises(ValueError, match="out"):
        rms_norm_triton(x, w, EPS, out=_nan((2, 8), torch.float16))
    with pytest.raises(ValueError, match="dtype"):
        rms_norm_triton(x.double(), w.double(), EPS)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_triton(_randn(gen, 2, 7))
    q, k = _randn(gen, 2, 2, 6), _randn(gen, 2, 1, 6)
    table = _randn(gen, 10, 6)
    pos = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rotary_embedding_triton(pos, _randn(gen, 2, 2, 5), _randn(gen, 2, 1, 5),
                                _randn(gen, 10, 5), _randn(gen, 10, 5))
    with pytest.raises(ValueError, match="dtypes differ"):
        rotary_embedding_triton(pos, q, k.to(torch.bfloat16), table, table)
    with pytest.raises(ValueError, match="disagree"):
        rotary_embedding_triton(pos[:1], q, k, table, table)
    with pytest.raises(ValueError, match="unit stride"):
        rotary_embedding_triton(pos, q.transpose(1, 2).contiguous().transpose(1, 2), k,
                                table, table)
    with pytest.raises(ValueError, match="integers"):
        rotary_embedding_triton(pos.float(), q, k, table, table)


def test_empty_inputs():
    w = _randn(_gen("empty"), 8)
    assert rms_norm_triton(torch.empty(0, 8, device=DEVICE), w, EPS).shape == (0, 8)
    out, res = fused_add_rms_norm_triton(torch.empty(0, 8, device=DEVICE),
                                         torch.empty(0, 8, device=DEVICE), w, EPS)
    assert out.shape == res.shape == (0, 8)
    assert silu_and_mul_triton(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)


# ---------------------------------------------------------------------------------------------
# the GPU code path, compiled without a GPU

_COMPILE_FOR_H100 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from manylora.ops import triton_fused as tf

    assert tf.GPU_MATH

    def ptx(fn, types, consts, divisible, warps):
        sig = {name: types.get(name, "constexpr") for name in fn.arg_names}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
        src = ASTSource(fn, sig, consts, attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "enable_fp_fusion": False}).asm["ptx"]

    p = ["x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr"]
    s = ["stride_x", "stride_res", "stride_out", "stride_res_out"]
    rms_types = {**dict.fromkeys(p, "*bf16"), **dict.fromkeys(s, "i32"), "n_cols": "i32",
                 "eps": "fp32"}
    rms_consts = {"HAS_RESIDUAL": True, "ONE_PASS": True, "BLOCK": 4096, "GPU_MATH": True}
    rms = ptx(tf._rms_norm_kernel, rms_types, {**rms_consts, "UNIT_OFFSET": False},
              p + s + ["n_cols"], 8)
    gemma = ptx(tf._rms_norm_kernel, rms_types, {**rms_consts, "UNIT_OFFSET": True},
                p + s + ["n_cols"], 8)
    silu = ptx(tf._silu_and_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16",
                                         "stride_x": "i32", "stride_out": "i32",
                                         "n_inter": "i32"},
               {"BLOCK": 1024, "GPU_MATH": True},
               ["x_ptr", "out_ptr", "stride_x", "stride_out", "n_inter"], 4)
    rs = ["stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_cos", "stride_sin"]
    rope = ptx(tf._rotary_kernel, {"pos_ptr": "*i64", "q_ptr": "*fp32", "k_ptr": "*fp32",
                                   "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                                   **dict.fromkeys(rs, "i32"), "n_q_heads": "i32",
                                   "n_k_heads": "i32", "half": "i32"},
               {"BLOCK_H": 16, "BLOCK_HALF": 64},
               ["q_ptr", "k_ptr", "cos_ptr", "sin_ptr", *rs, "half"], 4)
    assert "fma" not in rms and "fma" not in gemma and "fma" not in rope, "FMA contraction"
    assert "div.rn.f32" in rms and "div.rn.f32" in silu and "div.full" not in silu
    assert "rsqrt.approx" in rms
    for code in (rms, silu, rope):
        assert "ld.global.v4" in code, "unvectorized loads"
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernels themselves")
def test_kernels_compile_for_h100(compile_for_h100):
    """The libdevice branch (GPU_MATH) never runs under the interpreter: compile it for sm_90
    with Triton's bundled ptxas and check the PTX."""
    compile_for_h100(_COMPILE_FOR_H100)
