"""LoRA on the experts of a fused mixture-of-experts layer (vLLM's ``fused_moe_lora``, the
punica wrapper's ``add_lora_fused_moe``).

Every (slot, expert) has its own adapter matrices for the gate, up and down projections. For
token ``t`` with adapter slot ``s = slot[t]`` (-1: a base-model row) and each of its ``k``
routed experts ``e = e[t, j]`` with weight ``w[t, j]``::

    g = x W_G[e]ᵀ + [s ≥ 0] (x A_g[s,e,:r_g]ᵀ) B_g[s,e,:r_g]
    u = x W_U[e]ᵀ + [s ≥ 0] (x A_u[s,e,:r_u]ᵀ) B_u[s,e,:r_u]
    a = f(g) * u
    o = a W2[e]ᵀ + [s ≥ 0] (a A_d[s,e,:r_d]ᵀ) B_d[s,e,:r_d]
    y[t] = Σ_j w[t, j] · o_j

with ``r_m = ranks[s, m]`` the (slot, module)'s true rank (0: the slot's adapter does not
target the module; nothing of it is read) and B stored rank-major (``[R, out]``, rows
``[0, r)`` used, the LoRA scaling folded in). Per tensor-parallel rank the same formula holds
on the rank's shards (gate/up column-parallel, down row-parallel, the caller all-reduces
``y``).

``fused_experts_lora`` runs, on CUDA, the Triton path, by one of two launch plans
(``moe_lora_path``). Decode-sized batches (``"pairs"``): the base fused-MoE op of
``manylora.ops.triton_fused_moe`` (its alignment by expert, its two grouped GEMMs, the sum
over ``k``) with the LoRA terms inside its launches (``manylora.lora.kernels.
moe_lora_fused``): each GEMM's epilogue adds its expand, the activation computes the down
shrink, and one launch before the first GEMM computes the gate/up shrink by (token, expert)
pair (``moe_lora_pairs``). Large batches and prefill (``"grouped"``): the base op with, after
each GEMM, a shrink and an expand launch over the LoRA rows' pairs sorted by (slot, expert)
(``fused_moe_lora_kernels``), each group's A and B read once for all its pairs. Elsewhere it
runs the torch path: ``manylora.ops.fused_moe.fused_experts_torch``'s loop over the experts,
each expert's LoRA rows gathering their slot's A and B (``a_gate[slots, e]``) for a ``bmm``.
All add the LoRA terms in float32 and round once with the base term; the down-side term is
weighted by ``w`` like the base term (see ``fused_experts_lora``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from manylora.lora.kernels.fused_moe_lora_kernels import MoELoRAPlan
from manylora.lora.kernels.moe_lora_fused import act_and_down_shrink, lora_grouped_gemm
from manylora.lora.kernels.moe_lora_pairs import moe_lora_pair_shrink
from manylora.ops.fused_moe import ExpertDelta, fused_experts_torch
from manylora.ops.triton_fused_moe import (
    check_experts,
    fused_experts_triton,
    moe_align_block_size,
    moe_config,
)


class MoELoRAWeights(NamedTuple):
    """The LoRA slot buffers of one MoE layer's experts (``L`` slots, ``E`` experts, rank
    ``R`` at most, ``H`` hidden, ``I`` this tensor-parallel rank's intermediate width). One
    dtype for the six stacks: the model's, or float32 over a 16-bit model.

    Attributes:
        a_gate, a_up: ``[L, E, R, H]``.
        b_gate, b_up: ``[L, E, R, I]``, rank-major (B transposed), the scaling folded in.
        a_down: ``[L, E, R, I]``.
        b_down: ``[L, E, R, H]``, rank-major, the scaling folded in.
        ranks: int32 ``[L, 3]``, the true rank of (slot, gate / up / down); 0: the slot's
            adapter does not target that module (nothing read).
    """

    a_gate: torch.Tensor
    b_gate: torch.Tensor
    a_up: torch.Tensor
    b_up: torch.Tensor
    a_down: torch.Tensor
    b_down: torch.Tensor
    ranks: torch.Tensor


def check_moe_lora(x: torch.Tensor, w13: torch.Tensor, token_slots: torch.Tensor,
                   lora: MoELoRAWeights) -> None:
    """Raise ValueError unless ``token_slots`` is int32 ``[T]`` and ``lora``'s stacks fit the
    experts ``w13 [E, 2I, H]``: one ``L`` and ``R``, the shapes of ``MoELoRAWeights``, one
    dtype (x's or float32), ranks int32 ``[L, 3]``, all on x's device."""
    num_experts, two_i, hidden = w13.shape
    if token_slots.dtype != torch.int32 or tuple(token_slots.shape) != (x.shape[0],):
        raise ValueError(f"fused_experts_lora: token_slots must be int32 [{x.shape[0]}], got "
                         f"{tuple(token_slots.shape)} {token_slots.dtype}")
    if lora.a_gate.dim() != 4:
        raise ValueError(f"fused_experts_lora: a_gate must be [L, E, R, H], got "
                         f"{tuple(lora.a_gate.shape)}")
    max_loras, _, max_rank, _ = lora.a_gate.shape
    inter = two_i // 2
    want = {"a_gate": hidden, "b_gate": inter, "a_up": hidden, "b_up": inter,
            "a_down": inter, "b_down": hidden}
    for name, width in want.items():
        shape = (max_loras, num_experts, max_rank, width)
        t = getattr(lora, name)
        if tuple(t.shape) != shape:
            raise ValueError(f"fused_experts_lora: {name} is {tuple(t.shape)}, expected "
                             f"[L, E, R, {'H' if width == hidden else 'I'}] = {shape}")
        if t.dtype != lora.a_gate.dtype or t.dtype not in (x.dtype, torch.float32):
            raise ValueError(f"fused_experts_lora: the LoRA stacks must share one dtype, x's "
                             f"({x.dtype}) or float32, got {name} {t.dtype}")
    if lora.ranks.dtype != torch.int32 or tuple(lora.ranks.shape) != (max_loras, 3):
        raise ValueError(f"fused_experts_lora: ranks must be int32 [{max_loras}, 3], got "
                         f"{tuple(lora.ranks.shape)} {lora.ranks.dtype}")
    if any(t.device != x.device for t in (token_slots, *lora)):
        raise ValueError(f"fused_experts_lora: tensors on different devices: "
                         f"{[str(t.device) for t in (x, token_slots, *lora)]}")


def fused_experts_lora(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       token_slots: torch.Tensor, lora: MoELoRAWeights,
                       activation: str = "silu", path: str | None = None) -> torch.Tensor:
    """The routed experts' MLP with each token's adapter on every expert (module docstring),
    vLLM's ``fused_moe_lora``: ``x.is_cuda`` → the Triton path (no host synchronisation,
    fixed worst-case sizes: CUDA-graph capturable once compiled), else the torch path.

    Rounding (``r`` to x's dtype): the LoRA terms are accumulated in float32 (the GEMM input
    widened to float32 over float32 stacks), the shrink output rounded to B's dtype before the
    expand; ``g, u = r(r(x W13ᵀ) + δ_gu)``; the down term is weighted by the routing weight
    in float32 and added to the base GEMM's weighted output before one rounding and the sum
    over ``k``: ``o = r(o_base + w · δ_d)`` with ``o_base`` the base path's weighted float32
    value (torch: ``w · r(a W2ᵀ)``; Triton: ``r(w · a W2ᵀ)``, its stored output). Rows of slot
    -1 and (slot, module)s of rank 0 get no addition: an all-base batch gives exactly
    ``manylora.ops.fused_moe.fused_experts``' result.

    Args:
        x: ``[T, H]`` float32 / bfloat16 / float16, unit stride along ``H``.
        w13: ``[E, 2I, H]`` contiguous, x's dtype: gate rows then up rows.
        w2: ``[E, H, I]`` contiguous, x's dtype.
        topk_weights: float32 ``[T, k]`` (``select_experts``).
        topk_ids: int32 ``[T, k]`` expert ids in ``[0, E)``.
        token_slots: int32 ``[T]``, each token's adapter slot in ``[0, L)``, -1 for a base
            row (neither ids nor slots are range-checked: that would synchronise).
        lora: the layer's :class:`MoELoRAWeights` (contiguous stacks on the Triton path).
        activation: ``"silu"`` or ``"gelu_tanh"``.
        path: the Triton path's launch plan (``fused_experts_lora_triton``; None: by
            :func:`moe_lora_path`); the torch path has one.

    Returns:
        ``[T, H]`` in x's dtype (a new tensor).

    Raises:
        ValueError: an unknown activation or path, or shapes, dtypes, layouts or devices that
            do not fit together (the message names the argument).
    """
    check_experts(x, w13, w2, topk_weights, topk_ids, activation)
    check_moe_lora(x, w13, token_slots, lora)
    if x.is_cuda:
        return fused_experts_lora_triton(x, w13, w2, topk_weights, topk_ids, token_slots,
                                          lora, activation, path)
    return fused_experts_lora_torch(x, w13, w2, topk_weights, topk_ids, token_slots, lora,
                                    activation)


def fused_experts_lora_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                             topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                             token_slots: torch.Tensor, lora: MoELoRAWeights,
                             activation: str = "silu") -> torch.Tensor:
    """The torch path of ``fused_experts_lora`` (same arguments, not checked): its reference
    and CPU path. ``fused_experts_torch``'s loop over the experts present; for each, the rows
    whose (slot, module) rank is positive gather their slot's A and B and take two ``bmm``,
    A and B rows at or past the rank masked out (``torch.where``, so what they hold never
    reaches the result). Synchronises with the device (``torch.unique``, ``nonzero``)."""
    ranks = lora.ranks.long()
    slots = token_slots.long()
    gate_up = _expert_delta(slots, ranks, ((lora.a_gate, lora.b_gate, 0),
                                           (lora.a_up, lora.b_up, 1)))
    down = _expert_delta(slots, ranks, ((lora.a_down, lora.b_down, 2),))
    return fused_experts_torch(x, w13, w2, topk_weights, topk_ids, activation,
                               gate_up_delta=gate_up, down_delta=down)


def _expert_delta(slots: torch.Tensor, ranks: torch.Tensor,
                  modules: tuple[tuple[torch.Tensor, torch.Tensor, int], ...]) -> ExpertDelta:
    """The ``ExpertDelta`` of one GEMM side: the LoRA terms of ``modules`` (``(A, B, ranks
    column)`` each, their outputs side by side) for the rows whose slot has a positive rank
    in any of them."""
    columns = [m for _, _, m in modules]

    def delta(expert: int, token: torch.Tensor, inp: torch.Tensor):
        slot = slots[token]
        rank = torch.where(slot[:, None] >= 0, ranks[slot.clamp_min(0)][:, columns], 0)
        rows = torch.nonzero(rank.amax(dim=1) > 0).squeeze(1)
        if rows.numel() == 0:
            return None
        slot, rank = slot[rows], rank[rows]
        vec = inp[rows].float()[:, :, None]                          # [n, K, 1]
        out = []
        for i, (a_stack, b_stack, _) in enumerate(modules):
            keep = (torch.arange(a_stack.shape[2], device=slot.device)[None, :]
                    < rank[:, i, None])[:, :, None]                  # [n, R, 1]
            a = torch.where(keep, a_stack[slot, expert], 0).float()  # [n, R, K]
            b = torch.where(keep, b_stack[slot, expert], 0)          # [n, R, N]
            buf = torch.bmm(a, vec).to(b.dtype).float()              # [n, R, 1]
            out.append(torch.bmm(buf.transpose(1, 2), b.float()).squeeze(1))
        return rows, torch.cat(out, dim=1)

    return delta


def moe_lora_path(num_pairs: int, num_experts: int, max_loras: int) -> str:
    """Which launch plan ``fused_experts_lora_triton`` takes for ``num_pairs = T * k`` pairs:
    ``"pairs"`` (the LoRA inside the base op's launches, each pair reading its own A and B:
    ``moe_lora_fused``) while the pairs are at most twice the ``L * E`` (slot, expert)
    groups, so that the re-reads of a group's A and B (from L2) cost less than an alignment of
    their own (decode); else ``"grouped"`` (``MoELoRAPlan``: pairs sorted by (slot, expert),
    each group's A and B read once for all its pairs: large batches, prefill). The bound is
    where ``benchmarks/bench_moe_lora.py`` found the grouped plan faster."""
    return "pairs" if num_pairs <= 2 * max_loras * num_experts else "grouped"


def fused_experts_lora_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                              token_slots: torch.Tensor, lora: MoELoRAWeights,
                              activation: str = "silu", path: str | None = None
                              ) -> torch.Tensor:
    """The Triton path of ``fused_experts_lora`` (same arguments; the base ones checked by
    ``check_experts``, ``lora`` by the caller). ``path`` (None: :func:`moe_lora_path`'s
    choice) picks the launches:

    * ``"pairs"``: the base op's alignment by expert and its config; the gate/up shrink by
      pair; the first grouped GEMM with the gate/up expand in its epilogue; the activation
      with the down shrink (SiLU; the tanh GELU in torch, then the shrink alone); the second,
      weighted GEMM with the down expand in its epilogue; the sum over ``k``. One launch
      beyond the base op's.
    * ``"grouped"``: ``fused_experts_triton`` with a shrink and an expand launch after its
      first GEMM (gate and up, into its gate/up cache) and after its second, weighted one (the
      routing-weighted down term), over the pairs sorted by (slot, expert) (one alignment for
      both sides).

    Both compute the module docstring's formula with its rounding. No host synchronisation;
    CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``. The slot stacks must be
    contiguous.

    Raises:
        ValueError: what ``check_experts`` refuses, non-contiguous slot stacks, or an unknown
            ``path``.
    """
    check_experts(x, w13, w2, topk_weights, topk_ids, activation)
    if not all(t.is_contiguous() for t in lora[:6]):
        raise ValueError("fused_experts_lora: the LoRA slot stacks must be contiguous")
    if path not in (None, "pairs", "grouped"):
        raise ValueError(f"fused_experts_lora: path must be 'pairs', 'grouped' or None, got "
                         f"{path!r}")
    max_loras, num_experts, max_rank, _ = lora.a_gate.shape
    t, top_k = topk_ids.shape
    if t == 0 or top_k == 0 or max_rank == 0:
        return fused_experts_triton(x, w13, w2, topk_weights, topk_ids, activation)
    if (path or moe_lora_path(topk_ids.numel(), num_experts, max_loras)) == "pairs":
        return _experts_lora_fused(x, w13, w2, topk_weights, topk_ids, token_slots, lora,
                                   activation)
    gate_up_ranks, down_ranks = lora.ranks[:, 0:2], lora.ranks[:, 2:3]
    plan = MoELoRAPlan(topk_ids, token_slots, num_experts, max_loras, max_rank)

    def add_gate_up(gate_up: torch.Tensor) -> None:
        buf = plan.shrink(x, (lora.a_gate, lora.a_up), gate_up_ranks, top_k)
        plan.expand(gate_up, buf, (lora.b_gate, lora.b_up), gate_up_ranks, None)

    def add_down(act: torch.Tensor, out: torch.Tensor) -> None:
        buf = plan.shrink(act, (lora.a_down,), down_ranks, 1)
        plan.expand(out, buf, (lora.b_down,), down_ranks, topk_weights.reshape(-1))

    return fused_experts_triton(x, w13, w2, topk_weights, topk_ids, activation,
                                add_gate_up=add_gate_up, add_down=add_down)


def _experts_lora_fused(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        token_slots: torch.Tensor, lora: MoELoRAWeights,
                        activation: str) -> torch.Tensor:
    """The ``"pairs"`` plan of ``fused_experts_lora_triton`` (its arguments, checked)."""
    t, h = x.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    gate_up_ranks, down_ranks = lora.ranks[:, 0:2], lora.ranks[:, 2:3]
    buf = moe_lora_pair_shrink(x, (lora.a_gate, lora.a_up), gate_up_ranks, topk_ids,
                               token_slots, top_k)
    config = moe_config(t, top_k, num_experts)
    aligned = moe_align_block_size(topk_ids, config[0], num_experts)
    num_pairs = t * top_k
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=x.dtype, device=x.device)
    lora_grouped_gemm(x, w13, gate_up, None, *aligned, top_k, config, buf,
                      (lora.b_gate, lora.b_up), gate_up_ranks, token_slots, top_k)
    act = None
    if activation == "gelu_tanh":
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") * up
    act, buf = act_and_down_shrink(gate_up, act, lora.a_down, down_ranks, topk_ids,
                                   token_slots)
    out = torch.empty(num_pairs, h, dtype=x.dtype, device=x.device)
    lora_grouped_gemm(act, w2, out, topk_weights.reshape(-1), *aligned, 1, config, buf,
                      (lora.b_down,), down_ranks, token_slots, top_k)
    return out.view(t, top_k, h).sum(dim=1)
