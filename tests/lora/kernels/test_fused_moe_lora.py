"""LoRA on the experts of a fused MoE layer (``manylora.lora.kernels.fused_moe_lora``) against
a float64 evaluation of

    g = x W_G[e]ᵀ + (x A_g[s,e,:r_g]ᵀ) B_g[s,e,:r_g],   u likewise,   a = f(g) · u
    o = a W2[e]ᵀ + (a A_d[s,e,:r_d]ᵀ) B_d[s,e,:r_d],    y[t] = Σ_j w[t, j] · o_j

written here token by token and expert by expert (no LoRA term for slot -1 or rank 0).

Every path is checked: the torch path, and both launch plans of the Triton path, the LoRA
inside the base op's launches (the gate/up shrink by (token, expert) pair, the expands in the
GEMMs' epilogues, the down shrink in the activation) and the pairs grouped by (slot, expert)
(on CPU tensors under Triton's interpreter: ``tests/conftest.py`` sets
``TRITON_INTERPRET=1``). Shapes are odd (H
and I not multiples of the blocks), routing is top-1/2/8 of 4/8/16 experts, ranks are mixed
from 1 to R with some (slot, module) ranks 0, base rows are mixed in, for T = 1 (decode) and
T = 37 (prefill-like). Everything of A and B at or past a (slot, module)'s rank is NaN: neither path
may let it reach the result. A batch of base rows only (or of rank-0 modules only) equals
``fused_experts`` bit for bit. Without a GPU the kernels are also compiled for sm_90; with
one a ``gpu`` test replays the Triton path in a CUDA graph.

Tolerance, normwise ``‖out - y‖ / ‖y‖ ≤ NORMWISE_UNITS · u`` and elementwise ``|out - y| ≤
ELEMENT_UNITS · u · Y`` (``Y = max |y|`` of the row), ``u`` the unit roundoff of x's dtype.
The operands are scaled so that every product and every LoRA term is O(1) (the LoRA terms
make up 60-90 % of ‖y‖). bfloat16: about eight roundings lie on an output's path (``h``, the
LoRA buffer to B's dtype, ``g``/``u`` after the LoRA add, ``f(g)``, ``a``, the down output,
``o``, ``y``), each at most ``2u`` relative since the interpreter truncates: ``16u`` first
order, asserted with a factor 1.5 (24); the float32 accumulations (``K ≤ 300`` terms,
``300 · 2⁻²⁴``) stay below a tenth of one bfloat16 ``u``. float32: the accumulations
dominate, ``K u`` with ``K ≤ 72`` plus the eight roundings (80); the one shape with ``K =
300`` (the split loops') sums random-signed terms, whose error grows as ``√K u`` (about
17). The normwise bounds are those over about 3 (measured: at most 4.4 u in bfloat16, 4 u
in float32 on both paths).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from manylora.lora.kernels.fused_moe_lora import (
    MoELoRAWeights,
    fused_experts_lora,
    fused_experts_lora_torch,
    fused_experts_lora_triton,
    moe_lora_path,
)
from manylora.lora.kernels.fused_moe_lora_kernels import moe_lora_align
from manylora.ops.fused_moe import fused_experts
from manylora.ops.triton_fused_moe import fused_experts_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}
NORMWISE_UNITS = {torch.float32: 16, torch.bfloat16: 12}
ELEMENT_UNITS = {torch.float32: 80, torch.bfloat16: 24}
ACT = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


def _operands(t, e, k, h, i, max_loras, max_rank, dtype, lora_dtype=None, seed=0,
              base_every=3, zero_every=4):
    """``(x, w13, w2, weights, ids, slots, lora)``: every ``base_every``-th token a base row
    (0: none), ranks cycling over 1..R with every ``zero_every``-th (slot, module) 0 (0: none),
    NaN in A and B past each rank."""
    gen = torch.Generator().manual_seed(seed)
    lora_dtype = lora_dtype or dtype
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(dtype)
    logits = torch.randn(t, e, generator=gen)
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    slots = torch.randint(0, max_loras, (t,), generator=gen, dtype=torch.int32)
    if base_every:
        slots[::base_every] = -1
    ranks = torch.tensor([[1 + (3 * s + 5 * m + seed) % max_rank for m in range(3)]
                          for s in range(max_loras)], dtype=torch.int32)
    if zero_every:
        ranks.view(-1)[zero_every - 1::zero_every] = 0
    ranks[0, 0] = max_rank                               # the full rank once
    stacks = []
    for width_in, width_out in ((h, i), (h, i), (i, h)):
        a = torch.randn(max_loras, e, max_rank, width_in, generator=gen) / width_in ** 0.5
        b = torch.randn(max_loras, e, max_rank, width_out, generator=gen) / max_rank ** 0.5
        stacks += [a, b]
    for m in range(3):
        for s in range(max_loras):
            stacks[2 * m][s, :, ranks[s, m]:] = float("nan")
            stacks[2 * m + 1][s, :, ranks[s, m]:] = float("nan")
    lora = MoELoRAWeights(*(a.to(lora_dtype).to(DEVICE) for a in stacks), ranks.to(DEVICE))
    return (*(a.to(DEVICE) for a in (x, w13, w2, weights, ids.to(torch.int32), slots)), lora)


def _reference(x, w13, w2, weights, ids, slots, lora, activation="silu"):
    """float64 ``y [T, H]``, one token and one chosen expert at a time."""
    f = ACT[activation]
    c = [a.cpu().double() for a in (x, w13, w2, weights)]
    x, w13, w2, weights = c
    ids, slots, ranks = ids.cpu().tolist(), slots.cpu().tolist(), lora.ranks.cpu().tolist()
    st = [a.cpu().double() for a in lora[:6]]
    inter = w2.shape[2]
    y = torch.zeros_like(x)

    def term(v, m, s, e):
        r = ranks[s][m] if s >= 0 else 0
        if r == 0:
            return 0.0
        return (v @ st[2 * m][s, e, :r].T) @ st[2 * m + 1][s, e, :r]

    for t in range(x.shape[0]):
        s = slots[t]
        for j, e in enumerate(ids[t]):
            g = x[t] @ w13[e, :inter].T + term(x[t], 0, s, e)
            u = x[t] @ w13[e, inter:].T + term(x[t], 1, s, e)
            a = f(g) * u
            y[t] += weights[t, j] * (a @ w2[e].T + term(a, 2, s, e))
    return y


def _assert_close(out, ops, activation="silu"):
    x = ops[0]
    y = _reference(*ops, activation=activation)
    assert out.dtype == x.dtype and out.shape == x.shape
    err = (out.cpu().double() - y)
    normwise = (err.norm() / y.norm()).item() / UNIT[x.dtype]
    assert normwise <= NORMWISE_UNITS[x.dtype], f"normwise error {normwise:.3g} u"
    row_max = y.abs().amax(dim=1, keepdim=True)
    worst = (err.abs() / row_max).max().item() / UNIT[x.dtype]
    assert worst <= ELEMENT_UNITS[x.dtype], f"elementwise error {worst:.3g} u of the row max"


PATHS = ["torch", "triton-pairs", "triton-grouped"]
SHAPES = {                                   # (T, E, k, H, I, L, R)
    "decode-top1of4": (1, 4, 1, 40, 24, 3, 8),
    "decode-top8of16": (1, 16, 8, 33, 19, 2, 16),
    "prefill-top2of8": (37, 8, 2, 72, 40, 4, 16),
    "prefill-top8of16-odd": (37, 16, 8, 33, 19, 3, 5),
    "small-top2of4-rank1": (5, 4, 2, 24, 16, 2, 1),
    "decode-top2of4-rank64-split": (3, 4, 2, 300, 150, 2, 64),   # K and N over programs
}
DTYPES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None),
          "bf16-fp32lora": (torch.bfloat16, torch.float32)}


def _run(path, *ops, activation="silu"):
    if path == "torch":
        return fused_experts_lora_torch(*ops, activation=activation)
    return fused_experts_lora_triton(*ops, activation, path=path.removeprefix("triton-"))


# the per-pair plan under the interpreter costs a program per (pair, split, module): its
# largest shape (296 pairs) runs in one dtype
CASES = [(path, shape, dtype) for path in PATHS for shape in SHAPES for dtype in DTYPES
         if not (path == "triton-pairs" and shape == "prefill-top8of16-odd" and dtype != "fp32")]


@pytest.mark.parametrize("path,shape,dtype", CASES)
def test_matches_float64(path, shape, dtype):
    t, e, k, h, i, max_loras, max_rank = SHAPES[shape]
    model_dtype, lora_dtype = DTYPES[dtype]
    ops = _operands(t, e, k, h, i, max_loras, max_rank, model_dtype, lora_dtype,
                    seed=t + e + k)
    if t == 1:
        ops[5].fill_(1)                       # decode: the one token has an adapter
    _assert_close(_run(path, *ops), ops)


@pytest.mark.parametrize("path", PATHS)
def test_gelu_tanh_and_no_base_rows(path):
    ops = _operands(9, 8, 2, 40, 24, 3, 8, torch.float32, base_every=0, zero_every=0, seed=3)
    _assert_close(_run(path, *ops, activation="gelu_tanh"), ops, activation="gelu_tanh")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", PATHS)
def test_all_base_or_rank_zero_equals_fused_experts(path, dtype):
    """Slot -1 everywhere, then every rank 0: bit-equal to the base op of the same path."""
    ops = _operands(37, 8, 2, 40, 24, 3, 8, dtype, seed=7)
    x, w13, w2, weights, ids, slots, lora = ops
    if path == "torch":
        base = fused_experts(x, w13, w2, weights, ids)
    else:
        base = fused_experts_triton(x, w13, w2, weights, ids)
    all_base = torch.full_like(slots, -1)
    assert torch.equal(_run(path, x, w13, w2, weights, ids, all_base, lora), base)
    no_rank = lora._replace(ranks=torch.zeros_like(lora.ranks))
    assert torch.equal(_run(path, x, w13, w2, weights, ids, slots, no_rank), base)


def test_dispatch_takes_the_torch_path_on_cpu():
    ops = _operands(5, 4, 2, 24, 16, 2, 4, torch.float32)
    if DEVICE.type == "cpu":
        assert torch.equal(fused_experts_lora(*ops), fused_experts_lora_torch(*ops))


def test_bad_arguments_are_named():
    x, w13, w2, weights, ids, slots, lora = _operands(3, 4, 2, 24, 16, 2, 4, torch.float32)
    args = (x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match="activation 'relu'"):
        fused_experts_lora(*args, slots, lora, activation="relu")
    with pytest.raises(ValueError, match="do not chain"):
        fused_experts_lora(x, w13, w2[:, :, :-1].contiguous(), weights, ids, slots, lora)
    with pytest.raises(ValueError, match="token_slots"):
        fused_experts_lora(*args, slots[:-1], lora)
    with pytest.raises(ValueError, match="token_slots"):
        fused_experts_lora(*args, slots.long(), lora)
    with pytest.raises(ValueError, match="b_up"):
        fused_experts_lora(*args, slots, lora._replace(b_up=lora.b_up[:, :, :, :-1]))
    with pytest.raises(ValueError, match="a_down"):
        fused_experts_lora(*args, slots, lora._replace(a_down=lora.a_down[:, :-1]))
    with pytest.raises(ValueError, match="a_gate"):
        fused_experts_lora(*args, slots, lora._replace(a_gate=lora.a_gate[0]))
    with pytest.raises(ValueError, match="share one dtype"):
        fused_experts_lora(*args, slots, lora._replace(b_down=lora.b_down.double()))
    with pytest.raises(ValueError, match="ranks"):
        fused_experts_lora(*args, slots, lora._replace(ranks=lora.ranks[:, :2]))
    with pytest.raises(ValueError, match="ranks"):
        fused_experts_lora(*args, slots, lora._replace(ranks=lora.ranks.long()))
    strided = lora._replace(a_up=lora.a_up.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="contiguous"):
        fused_experts_lora_triton(*args, slots, strided)
    with pytest.raises(ValueError, match="path must be"):
        fused_experts_lora_triton(*args, slots, lora, path="sorted")


def test_path_by_pairs_per_group():
    """By pair while the pairs are at most twice the (slot, expert) groups."""
    assert moe_lora_path(64 * 8, 128, 16) == "pairs"
    assert moe_lora_path(256 * 8, 128, 16) == "pairs"
    assert moe_lora_path(512 * 8, 128, 16) == "pairs"
    assert moe_lora_path(512 * 8 + 1, 128, 16) == "grouped"


def _python_align(ids, slots, block_m, num_experts):
    """The LoRA alignment by a plain sort: (sorted pairs, block keys, padded total)."""
    flat = ids.reshape(-1).tolist()
    k = ids.shape[1]
    keys = [slots[p // k] * num_experts + e if slots[p // k] >= 0 else None
            for p, e in enumerate(flat)]
    sorted_ids, block_keys = [], []
    for key in sorted({key for key in keys if key is not None}):
        run = [p for p in range(len(flat)) if keys[p] == key]
        blocks = -(-len(run) // block_m)
        sorted_ids += run + [len(flat)] * (blocks * block_m - len(run))
        block_keys += [key] * blocks
    return sorted_ids, block_keys, len(sorted_ids)


@pytest.mark.parametrize("t,e,k,max_loras,block_m", [
    (1, 4, 1, 3, 16), (37, 8, 2, 4, 16), (37, 16, 8, 3, 32), (5, 4, 2, 2, 1), (64, 4, 4, 1, 16),
])
def test_align_by_slot_and_expert_matches_python_sort(t, e, k, max_loras, block_m):
    gen = torch.Generator().manual_seed(t + k)
    ids = torch.rand(t, e, generator=gen).topk(k, dim=-1).indices.to(torch.int32)
    slots = torch.randint(-1, max_loras, (t,), generator=gen, dtype=torch.int32)
    sorted_ids, block_keys, total = moe_lora_align(ids.to(DEVICE), slots.to(DEVICE), block_m,
                                                   e, max_loras)
    want_ids, want_keys, want_total = _python_align(ids, slots.tolist(), block_m, e)
    worst = t * k + min(max_loras * e, t * k) * (block_m - 1)
    assert sorted_ids.shape == (worst,) and block_keys.shape == (-(-worst // block_m),)
    assert total.tolist() == [want_total]
    assert sorted_ids.tolist() == want_ids + [t * k] * (worst - want_total)
    assert block_keys.tolist() == want_keys + [-1] * (block_keys.numel() - len(want_keys))


_COMPILE_FOR_H100 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from manylora.lora.kernels import fused_moe_lora_kernels as k
    from manylora.lora.kernels import moe_lora_fused as f
    from manylora.lora.kernels import moe_lora_pairs as p

    def ptx(fn, types, consts, **options):
        sig = {name: types.get(name, "constexpr") for name in fn.arg_names}
        return triton.compile(ASTSource(fn, sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, **options}).asm["ptx"]

    ints = {n: "i32" for n in ("num_experts", "K", "N", "num_pairs", "stride_xt", "stride_ot",
                               "stride_os", "stride_rank", "n_module", "stride_am",
                               "stride_we", "stride_wn", "stride_cm", "stride_hs", "stride_hp",
                               "stride_hm", "n_inter", "stride_gu", "stride_act")}
    ptrs = {n: "*i32" for n in ("ranks_ptr", "sorted_ids_ptr", "block_keys_ptr",
                                "expert_ids_ptr", "total_ptr", "slots_ptr", "ids_ptr")}
    for model, lora in (("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "fp32")):
        shrink = {**ints, **ptrs, "x_ptr": f"*{model}", "a0_ptr": f"*{lora}",
                  "a1_ptr": f"*{lora}", "out_ptr": "*fp32"}
        for row_div in (8, 1):
            code = ptx(k.moe_lora_shrink_kernel, shrink,
                       {"A_ROW_DIV": row_div, "R": 16, "BLOCK_M": 16, "BLOCK_R": 16,
                        "BLOCK_K": 64, "DOT_FP32": model != lora})
            assert ("mma" in code) == (lora == "bf16"), (model, lora, "shrink")
        expand = {**ints, **ptrs, "buf_ptr": "*fp32", "b0_ptr": f"*{lora}",
                  "b1_ptr": f"*{lora}", "y_ptr": f"*{model}", "topk_w_ptr": "*fp32",
                  "stride_bt": "i32", "stride_bs": "i32", "stride_yt": "i32"}
        for weighted in (False, True):
            code = ptx(k.moe_lora_expand_kernel, expand,
                       {"R": 64, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_R": 64,
                        "MUL_ROUTED_WEIGHT": weighted, "DOT_FP32": False})
            assert ("mma" in code) == (lora == "bf16"), (model, lora, "expand")
            assert "tf32" not in code
        pair = {**ints, **ptrs, "buf_ptr": "*fp32", "stride_vt": "i32"}
        for row_div in (8, 1):
            code = ptx(p.moe_lora_pair_shrink_kernel,
                       {**pair, "v_ptr": f"*{model}", "a0_ptr": f"*{lora}",
                        "a1_ptr": f"*{lora}"},
                       {"TOP_K": 8, "V_ROW_DIV": row_div, "R": 16, "BLOCK_R": 16,
                        "BLOCK_K": 256, "K_SPLITS": 4, "K_PER_SPLIT": 512})
            assert "mma" not in code and "tf32" not in code, (model, lora, "pair shrink")
        gemm = {**ints, **ptrs, "a_ptr": f"*{model}", "w_ptr": f"*{model}",
                "c_ptr": f"*{model}", "topk_w_ptr": "*fp32", "h_ptr": "*fp32",
                "b0_ptr": f"*{lora}", "b1_ptr": f"*{lora}"}
        for weighted, modules in ((False, 2), (True, 1)):
            code = ptx(f.moe_lora_gemm_kernel, gemm,
                       {"TOP_K": 8, "A_ROW_DIV": 1 if weighted else 8,
                        "MUL_ROUTED_WEIGHT": weighted, "DOT_FP32": False,
                        "IEEE": model == "fp32", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64,
                        "MODULES": modules, "R": 16, "H_SPLITS": 4}, num_stages=4)
            assert ("mma" in code) == (model == "bf16"), (model, lora, "gemm")
            assert "tf32" not in code
        act = {**ints, **ptrs, "gu_ptr": f"*{model}", "act_ptr": f"*{model}",
               "a_ptr": f"*{lora}", "h_ptr": "*fp32"}
        for silu in (True, False):
            code = ptx(f.moe_lora_act_kernel, act,
                       {"TOP_K": 8, "R": 16, "BLOCK_R": 16, "BLOCK": 256, "SILU": silu,
                        "GPU_MATH": True}, enable_fp_fusion=False)
            assert "mma" not in code, (model, lora, "act")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernels themselves")
def test_kernels_compile_for_h100(compile_for_h100):
    """The GPU build is never exercised under the interpreter: compile the shrink and expand
    kernels for sm_90 (bfloat16 stacks on tensor-core MMA; float32 stacks, also over a
    bfloat16 model, in IEEE float32, no TF32)."""
    compile_for_h100(_COMPILE_FOR_H100)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("path", ["pairs", "grouped"])
def test_cuda_graph_replay_matches_torch_path(path):
    """``fused_experts_lora`` (the alignments, the base GEMMs, the LoRA launches of ``path``,
    the activation and the sum) captured in a CUDA graph at a Qwen3-30B-A3B layer shape (H
    2048, I 768, 128 experts, top-8; 4 slots of rank ≤ 16), replayed on new activations,
    routing and slots: bit-equal to an eager call, and within the bound of the float64
    reference as the torch path is."""
    t, e, k, h, i, max_loras, max_rank = 64, 128, 8, 2048, 768, 4, 16
    x, w13, w2, weights, ids, slots, lora = _operands(t, e, k, h, i, max_loras, max_rank,
                                                      torch.bfloat16)

    def run(x, weights, ids, slots):
        return fused_experts_lora_triton(x, w13, w2, weights, ids, slots, lora, path=path)

    static = [a.clone() for a in (x, weights, ids, slots)]
    run(*static)                                                            # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(*static)
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        new_x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        new_w, new_ids = torch.randn(t, e, generator=gen).softmax(-1).topk(k, dim=-1)
        new_slots = torch.randint(-1, max_loras, (t,), generator=gen, dtype=torch.int32)
        new = [a.to(DEVICE) for a in (new_x, new_w / new_w.sum(-1, keepdim=True),
                                      new_ids.to(torch.int32), new_slots)]
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        ops = (new[0], w13, w2, *new[1:], lora)
        assert torch.equal(out, run(*new))
        _assert_close(out, ops)
        torch_path = fused_experts_lora_torch(*ops)
        _assert_close(torch_path, ops)
