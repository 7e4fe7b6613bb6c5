"""LoRA on a fused MoE layer's experts, one program per (token, expert) pair: shrink and
expand in one launch per GEMM side, no alignment (Punica's BGMV, Chen et al. 2023, over the
(slot, expert) stacks of vLLM's ``fused_moe_lora``).

For decode-sized batches each (slot, expert) holds about one of the ``T * k`` pairs, so a
grouped launch (``fused_moe_lora_kernels``: pairs sorted by (slot, expert), a 16-row block
per group) spends a block and an alignment of its own on one row. Here program ``(p, m)``
takes pair ``p = t * k + j`` and module ``m`` straight from the routing: with ``s =
slot[t]``, ``e = e[t, j]``, ``r = ranks[s, m]`` and the stacks ``[L, E, R, n]`` read as
``[L * E, R, n]`` at row ``s * E + e``::

    h       = r_B(v[row(p)] @ A_m[s, e, :r]ᵀ)                          (float32, then B's dtype)
    y[p, col_m + n] = r(y[p, col_m + n] + c_p · h @ B_m[s, e, :r, n])   (float32 sum)

``v`` is the first GEMM's input (x, ``row(p) = p // k``) or the second's (the activations,
``row(p) = p``); ``y`` is the base layer's gate/up cache (``col_m = m · n_out``) or its
weighted down output; ``c_p`` is 1 or the pair's routing weight; ``r_B`` rounds to B's dtype
and ``r`` once to ``y``'s. The program returns before it reads anything else when ``s = -1``
(a base-model row) or ``r = 0``; A and B rows at or past ``r`` are never read. The products
are float32 multiply-adds on the vector units (one row: no ``tl.dot``), the same on every
backend, in the interpreter too. The grid is ``(T * k, modules)``, from shapes only: no host
synchronisation, CUDA-graph capturable.

Each pair reads its own A and B, so pairs that share a (slot, expert) read them again (from
L2 when they run together); ``fused_moe_lora.fused_experts_lora_triton`` takes this path
while the pairs are at most the (slot, expert) groups, where a group holds about one pair.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from manylora.lora.kernels.jit_helpers import TABLE_ARGS, pick, slot_rank
from manylora.ops.host_math import next_power_of_2

#: Elements of one ``[BLOCK_R, BLOCK_K]`` A tile or ``[BLOCK_R, BLOCK_N]`` B tile.
_TILE = 4096


@triton.jit(do_not_specialize=TABLE_ARGS)
def moe_lora_pair_kernel(
        v_ptr, a0_ptr, a1_ptr, b0_ptr, b1_ptr, y_ptr, topk_w_ptr, ranks_ptr, slots_ptr,
        ids_ptr, num_experts, K, N, stride_vt, stride_yt, stride_rank,
        TOP_K: tl.constexpr, V_ROW_DIV: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr):
    """Grid ``(T * k, modules)``: pair ``p``'s shrink through module ``m``'s A and expand
    through its B, added into ``y[p, m * N : (m + 1) * N]``."""
    p = tl.program_id(0)
    m = tl.program_id(1)
    slot = tl.load(slots_ptr + p // TOP_K)
    if slot < 0:
        return
    rank = slot_rank(ranks_ptr, stride_rank, slot, m)
    if rank == 0:
        return
    key = slot.to(tl.int64) * num_experts + tl.load(ids_ptr + p).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = pick(m, a0_ptr, a1_ptr, a1_ptr) + key * (R * K) + offs_r[:, None] * K
    v_ptrs = v_ptr + (p // V_ROW_DIV).to(tl.int64) * stride_vt
    part = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + offs_k < K
        vt = tl.load(v_ptrs + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        at = tl.load(a_ptrs + k0 + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                     other=0.0).to(tl.float32)
        part += at * vt[None, :]
    b_base = pick(m, b0_ptr, b1_ptr, b1_ptr)
    h = tl.sum(part, axis=1).to(b_base.dtype.element_ty).to(tl.float32)   # [BLOCK_R]
    weight = 1.0
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_w_ptr + p)
    offs_n = tl.arange(0, BLOCK_N)
    b_ptrs = b_base + key * (R * N) + offs_r[:, None] * N
    y_ptrs = y_ptr + p.to(tl.int64) * stride_yt + m * N
    for n0 in range(0, N, BLOCK_N):
        n_mask = n0 + offs_n < N
        bt = tl.load(b_ptrs + n0 + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :],
                     other=0.0).to(tl.float32)
        delta = tl.sum(bt * h[:, None], axis=0) * weight
        y = tl.load(y_ptrs + n0 + offs_n, mask=n_mask, other=0.0)
        tl.store(y_ptrs + n0 + offs_n, (y.to(tl.float32) + delta).to(y.dtype), mask=n_mask)


def moe_lora_pairs(v: torch.Tensor, y: torch.Tensor, a_stacks: tuple[torch.Tensor, ...],
                   b_stacks: tuple[torch.Tensor, ...], ranks: torch.Tensor,
                   topk_ids: torch.Tensor, token_slots: torch.Tensor, row_div: int,
                   topk_weights: torch.Tensor | None) -> None:
    """Add the LoRA terms of ``S`` modules (module docstring) into ``y`` in place, one launch.

    Args:
        v: ``[T * k / row_div, K]`` the GEMM side's input (x: ``row_div = k``; the
            activations: 1), unit stride along ``K``.
        y: ``[T * k, S * N]`` the base GEMM's output by pair, unit stride along columns.
        a_stacks: ``S`` A stacks ``[L, E, R, K]``; b_stacks: ``S`` B stacks ``[L, E, R, N]``
            (rank-major, the scaling folded in); all contiguous, one dtype.
        ranks: int32 ``[L, S]`` view of the rank table (unit column stride).
        topk_ids: int32 / int64 ``[T, k]``; token_slots: int32 ``[T]`` (-1: base row).
        row_div: pairs per row of ``v``.
        topk_weights: float32 ``[T * k]`` to weight each pair's term by, or None.
    """
    num_pairs = topk_ids.numel()
    max_rank, k_in = a_stacks[0].shape[2:]
    n_out = b_stacks[0].shape[3]
    if num_pairs == 0 or max_rank == 0:
        return
    block_r = next_power_of_2(max_rank)
    block_k = max(16, min(_TILE // block_r, next_power_of_2(k_in)))
    block_n = max(16, min(_TILE // block_r, next_power_of_2(n_out)))
    ids = topk_ids.reshape(-1)
    moe_lora_pair_kernel[(num_pairs, len(a_stacks))](
        v, a_stacks[0], a_stacks[-1], b_stacks[0], b_stacks[-1], y,
        y if topk_weights is None else topk_weights, ranks, token_slots, ids,
        a_stacks[0].shape[1], k_in, n_out, v.stride(0), y.stride(0), ranks.stride(0),
        TOP_K=topk_ids.shape[1], V_ROW_DIV=row_div, R=max_rank, BLOCK_R=block_r,
        BLOCK_K=block_k, BLOCK_N=block_n, MUL_ROUTED_WEIGHT=topk_weights is not None,
        num_warps=4)
