"""LoRA on the experts of a fused MoE layer (``manylora.lora.kernels.fused_moe_lora``) against
a float64 evaluation of

    g = x W_G[e]ᵀ + (x A_g[s,e,:r_g]ᵀ) B_g[s,e,:r_g],   u likewise,   a = f(g) · u
    o = a W2[e]ᵀ + (a A_d[s,e,:r_d]ᵀ) B_d[s,e,:r_d],    y[t] = Σ_j w[t, j] · o_j

written here token by token and expert by expert (no LoRA term for slot -1 or rank 0).

Both paths are checked: the torch path, and the Triton path (on CPU tensors under Triton's
interpreter: ``tests/conftest.py`` sets ``TRITON_INTERPRET=1``). Shapes are odd (H and I not
multiples of the blocks), routing is top-1/2/8 of 4/8/16 experts, ranks are mixed from 1 to
R with some (slot, module) ranks 0, base rows are mixed in, for T = 1 (decode) and T = 37
(prefill-like). Everything of A and B at or past a (slot, module)'s rank is NaN: neither path
may let it reach the result. A batch of base rows only (or of rank-0 modules only) equals
``fused_experts`` bit for bit. Without a GPU the kernels are also compiled for sm_90; with
one a ``gpu`` test replays the Triton path in a CUDA graph.

Tolerance, normwise ``‖out - y‖ / ‖y‖ ≤ NORMWISE_UNITS · u`` and elementwise ``|out - y| ≤
ELEMENT_UNITS · u · Y`` (``Y = max |y|`` of the row), ``u`` the unit roundoff of x's dtype.
The operands are scaled so that every product is O(1): each of the about eight roundings on
an output's path (``h``, the LoRA buffer, ``g``/``u`` after the LoRA add, ``f(g)``, ``a``,
the down output, ``o``, ``y``) adds at most ``2u`` relative (the interpreter truncates), and
the float32 accumulations ``K · 2⁻²⁴`` (``K ≤ 72``) stay below one bfloat16 ``u``. In
float32 the accumulations dominate: ``72 · 2⁻²⁴`` is ``72 u``, hence the larger unit count
there (a bound on the worst element; measured normwise errors are far below).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from manylora.lora.kernels.fused_moe_lora import (
    MoELoRAWeights,
    fused_experts_lora,
    fused_experts_lora_torch,
    fused_experts_lora_triton,
)
from manylora.ops.fused_moe import fused_experts
from manylora.ops.triton_fused_moe import fused_experts_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}
NORMWISE_UNITS = {torch.float32: 64, torch.bfloat16: 16}
ELEMENT_UNITS = {torch.float32: 256, torch.bfloat16: 32}
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


PATHS = ["torch"]
SHAPES = {                                   # (T, E, k, H, I, L, R)
    "decode-top1of4": (1, 4, 1, 40, 24, 3, 8),
    "decode-top8of16": (1, 16, 8, 33, 19, 2, 16),
    "prefill-top2of8": (37, 8, 2, 72, 40, 4, 16),
    "prefill-top8of16-odd": (37, 16, 8, 33, 19, 3, 5),
    "small-top2of4-rank1": (5, 4, 2, 24, 16, 2, 1),
}
DTYPES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None),
          "bf16-fp32lora": (torch.bfloat16, torch.float32)}


def _run(path, *ops, activation="silu"):
    if path == "torch":
        return fused_experts_lora_torch(*ops, activation=activation)
    return fused_experts_lora_triton(*ops, activation)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("path", PATHS)
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
