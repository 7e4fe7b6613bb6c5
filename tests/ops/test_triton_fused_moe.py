"""The fused MoE kernels (``manylora.ops.triton_fused_moe``) against a float64 evaluation of

    y[t] = Σ_j w[t, j] · W2[e_tj] · act(W13[e_tj] x[t]),   act([g; u]) = f(g) · u

written here expert by expert (the way transformers' ``Qwen3MoeExperts`` loops), and the
alignment against a plain Python sort.

On CPU the kernels run under Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``), on CUDA when there is a GPU. Shapes are odd on purpose (H = 72 and
2I = 80 are not multiples of the 64-wide blocks, so the K loop and the N tiles both end on a
partial block); routing covers experts that get no token, every token on one expert, top-1,
top-2 and top-8 of 16. Without a GPU one more test compiles the grouped GEMM for an H100
(sm_90, no device needed); with one, a ``gpu`` test replays the op in a CUDA graph.

Error bound, per output element, first order in the roundings: each GEMM adds at most
``ε = 2v + K·2⁻²⁴`` relative to its magnitude (float32 accumulation of ``K`` products, one
rounding of the output; ``v = 2u``, one ulp, since the interpreter truncates on the store);
``h = x W13ᵀ`` carries ``ε·M`` with ``M = |x| |W13|ᵀ`` into ``a = f(g) · u``, where
``|f'| ≤ 1.2`` for SiLU and tanh-GELU, so ``|δa| ≤ ε · A`` with
``A = 1.2 |u| M_g + |f(g)| M_u + |a|`` (the last term the two roundings of ``a``); the second
GEMM and the routing weight give ``2ε · Σ_j |w| |W2| A``, and the per-slot and final roundings
``v · (Σ_j |o_j| + |y|)``. Asserted with a factor 1.5 over the first-order sum, together with
a normwise bound (``NORMWISE_UNITS``).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from manylora.ops.triton_fused_moe import (
    MOE_CONFIGS,
    fused_experts_triton,
    moe_align_block_size,
    moe_config,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
ACT = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}
H, INTER = 72, 40
# Normwise relative error ‖out - y‖ / ‖y‖ in unit roundoffs (measured on the interpreter: at
# most 3 in bfloat16, 5 in float32, over these cases); catches what the elementwise worst-case
# bound, loose by two orders in bfloat16, would let through.
NORMWISE_UNITS = 16


def _routing(gen, t, e, k, mode):
    """``(topk_weights [t, k] float32, topk_ids [t, k] int64)``, softmax-normalised."""
    logits = torch.randn(t, e, generator=gen)
    if mode == "one_expert":
        ids = torch.full((t, k), 2, dtype=torch.int64)
        return torch.ones(t, k) / k, ids
    if mode == "skewed":          # half the experts get nothing
        logits[:, e // 2:] -= 100.0
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def _operands(t, e, k, dtype, mode, seed=0, h=H, i=INTER):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(dtype)
    weights, ids = _routing(gen, t, e, k, mode)
    return [a.to(DEVICE) for a in (x, w13, w2, weights, ids)]


def _reference(x, w13, w2, weights, ids, activation):
    """float64 ``(y, Σ_j |w| |W2| A, Σ_j |o_j|)``: the formula and the magnitudes of the
    bound (module docstring)."""
    f = ACT[activation]
    x, weights, ids = x.cpu().double(), weights.cpu().double(), ids.cpu()
    t, h = x.shape
    i = w2.shape[2]
    y = torch.zeros(t, h, dtype=torch.float64)
    amp = torch.zeros(t, h, dtype=torch.float64)    # Σ_j |w| |W2| A
    slots = torch.zeros(t, h, dtype=torch.float64)  # Σ_j |o_j|
    for e in range(w13.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        xe, w13e, w2e = x[tok], w13[e].cpu().double(), w2[e].cpu().double()
        gate, up = (xe @ w13e.T).split(i, dim=-1)
        m_gate, m_up = (xe.abs() @ w13e.abs().T).split(i, dim=-1)
        a = f(gate) * up
        big_a = 1.2 * up.abs() * m_gate + f(gate).abs() * m_up + a.abs()
        w = weights[tok, slot][:, None]
        o = w * (a @ w2e.T)
        y.index_add_(0, tok, o)
        slots.index_add_(0, tok, o.abs())
        amp.index_add_(0, tok, w.abs() * (big_a @ w2e.abs().T))
    return y, amp, slots


def _assert_close(out, x, w13, w2, weights, ids, activation="silu"):
    y, amp, slots = _reference(x, w13, w2, weights, ids, activation)
    assert out.dtype == x.dtype and out.shape == x.shape
    v = 2 * UNIT[x.dtype]
    eps = 2 * v + max(x.shape[1], w2.shape[2]) * 2.0 ** -24
    bound = 1.5 * (2 * eps * amp + v * (slots + y.abs())) + 1e-30
    err = (out.cpu().double() - y).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"max error / bound {worst:.3g} (max error {err.max().item():.3g})"
    normwise = ((out.cpu().double() - y).norm() / y.norm()).item() / UNIT[x.dtype]
    assert normwise <= NORMWISE_UNITS, f"normwise error {normwise:.3g} unit roundoffs"


def _python_align(ids, block_m, num_experts):
    """The alignment by a plain sort of the pairs: (sorted ids, block experts, total)."""
    flat = ids.reshape(-1).tolist()
    pad = len(flat)
    sorted_ids, experts = [], []
    for e in range(num_experts):
        run = [p for p in sorted(range(len(flat)), key=lambda p: (flat[p], p)) if flat[p] == e]
        if not run:
            continue
        blocks = -(-len(run) // block_m)
        sorted_ids += run + [pad] * (blocks * block_m - len(run))
        experts += [e] * blocks
    return sorted_ids, experts, len(sorted_ids)


@pytest.mark.parametrize("t,k,e,block_m", [
    (1, 1, 4, 16), (3, 2, 4, 16), (17, 2, 8, 16), (64, 2, 8, 32), (17, 8, 16, 16),
    (64, 8, 16, 64), (5, 2, 4, 1), (64, 1, 4, 16),
])
def test_align_matches_python_sort(t, k, e, block_m):
    gen = torch.Generator().manual_seed(t * 100 + k)
    ids = torch.rand(t, e, generator=gen).topk(k, dim=-1).indices
    if (t, k, e) == (64, 1, 4):
        ids = torch.full_like(ids, 3)                   # every token on one expert
    for dtype in (torch.int64, torch.int32):
        sorted_ids, expert_ids, total = moe_align_block_size(ids.to(dtype).to(DEVICE),
                                                             block_m, e)
        want_ids, want_experts, want_total = _python_align(ids, block_m, e)
        worst = t * k + e * (block_m - 1)
        assert sorted_ids.dtype == expert_ids.dtype == total.dtype == torch.int32
        assert sorted_ids.shape == (worst,)
        assert expert_ids.shape == (-(-worst // block_m),)
        assert total.tolist() == [want_total]
        assert sorted_ids.tolist() == want_ids + [t * k] * (worst - want_total)
        n_blocks = want_total // block_m
        assert expert_ids.tolist() == want_experts + [-1] * (expert_ids.numel() - n_blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,e,k,mode", [
    (1, 4, 1, "random"), (3, 4, 2, "random"), (17, 8, 2, "random"), (64, 8, 2, "skewed"),
    (17, 16, 8, "random"), (64, 16, 8, "random"), (64, 4, 1, "one_expert"),
    (3, 8, 2, "one_expert"),
])
def test_fused_experts_match_float64(t, e, k, mode, dtype):
    ops = _operands(t, e, k, dtype, mode, seed=t + e + k)
    _assert_close(fused_experts_triton(*ops), *ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gelu_tanh_and_explicit_configs(dtype):
    """tanh-GELU; the rows of ``MOE_CONFIGS`` the other cases do not reach (BLOCK_M 32 and 64)
    and 16-row, 32-wide blocks (several K steps and N tiles, each ending on a partial block),
    on the same operands."""
    ops = _operands(5, 8, 2, dtype, "random", seed=5)
    _assert_close(fused_experts_triton(*ops, activation="gelu_tanh"), *ops,
                  activation="gelu_tanh")
    for config in (*(config for _, config in MOE_CONFIGS[1:]), (16, 32, 32, 4, 2)):
        _assert_close(fused_experts_triton(*ops, config=config), *ops)


def test_configs_follow_rows_per_expert():
    """The config is picked by ``ceil(T * k / E)``: decode at Qwen3-30B-A3B's 128 experts and
    top-8 stays on the first row far longer than at Mixtral's 8 experts and top-2."""
    assert moe_config(1, 8, 128) == MOE_CONFIGS[0][1]
    assert moe_config(256, 8, 128) == MOE_CONFIGS[0][1]       # 16 rows per expert
    assert moe_config(257, 8, 128) == MOE_CONFIGS[1][1]
    assert moe_config(65, 2, 8) == MOE_CONFIGS[1][1]          # 17 rows per expert
    assert moe_config(1 << 20, 2, 8) == MOE_CONFIGS[-1][1]


def test_bad_arguments_are_named():
    x, w13, w2, weights, ids = _operands(3, 4, 2, torch.float32, "random")
    with pytest.raises(ValueError, match="activation 'relu'"):
        fused_experts_triton(x, w13, w2, weights, ids, activation="relu")
    with pytest.raises(ValueError, match="do not chain"):
        fused_experts_triton(x, w13, w2[:, :, :-1].contiguous(), weights, ids)
    with pytest.raises(ValueError, match="share one dtype"):
        fused_experts_triton(x, w13.to(torch.bfloat16), w2, weights, ids)
    with pytest.raises(ValueError, match="float32"):
        fused_experts_triton(x, w13, w2, weights.double(), ids)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_align_block_size(ids.float(), 16, 4)
    assert fused_experts_triton(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, H)


_COMPILE_FOR_H100 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from manylora.ops import triton_fused_moe as moe

    def ptx(dtype, config, ieee):
        block_m, block_n, block_k, warps, stages = config
        fn = moe._fused_moe_kernel
        types = {"a_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "c_ptr": f"*{dtype}",
                 "topk_w_ptr": "*fp32", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32",
                 "total_ptr": "*i32", "N": "i32", "K": "i32", "num_pairs": "i32",
                 "stride_am": "i32", "stride_we": "i32", "stride_wn": "i32",
                 "stride_cm": "i32"}
        consts = {"A_ROW_DIV": 8, "MUL_ROUTED_WEIGHT": True, "DOT_FP32": False,
                  "IEEE": ieee, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
        sig = {name: types.get(name, "constexpr") for name in fn.arg_names}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                 for n in types if n != "num_pairs"}
        return triton.compile(ASTSource(fn, sig, consts, attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages}).asm["ptx"]

    for _, config in moe.MOE_CONFIGS:
        code = ptx("bf16", config, False)
        assert "mma" in code, ("no tensor-core MMA", config)
    code = ptx("fp32", moe.MOE_CONFIGS[0][1], True)
    assert "tf32" not in code and "mma" not in code, "float32 dot not in IEEE float32"
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernels themselves")
def test_kernel_compiles_for_h100(compile_for_h100):
    """The GPU build is never exercised under the interpreter: compile the grouped GEMM for
    sm_90 (every ``MOE_CONFIGS`` row in bfloat16, tensor-core MMA; float32 without TF32)."""
    compile_for_h100(_COMPILE_FOR_H100)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_matches_eager():
    """The whole ``fused_experts_triton`` (alignment, both GEMMs, activation, sum) captured in
    a CUDA graph at a Qwen3-30B-A3B layer shape (H 2048, I 768, 128 experts, top-8), replayed
    on new activations and routing: bit-equal to an eager call, and within the bound."""
    t, e, k = 64, 128, 8
    x, w13, w2, weights, ids = _operands(t, e, k, torch.bfloat16, "random", h=2048, i=768)
    static = [a.clone() for a in (x, weights, ids)]
    fused_experts_triton(static[0], w13, w2, static[1], static[2])   # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts_triton(static[0], w13, w2, static[1], static[2])
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        x2 = torch.randn(t, 2048, generator=gen).to(DEVICE, torch.bfloat16)
        weights2, ids2 = (a.to(DEVICE) for a in _routing(gen, t, e, k, "skewed"))
        for dst, src in zip(static, (x2, weights2, ids2)):
            dst.copy_(src)
        graph.replay()
        eager = fused_experts_triton(x2, w13, w2, weights2, ids2)
        assert torch.equal(out, eager)
        _assert_close(out, x2, w13, w2, weights2, ids2)
